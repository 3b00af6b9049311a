"""A restart loses nothing (issue 28): a real ``rollout-server serve`` on a SQLite state file
is SIGKILLed with 50 results published but never collected and 20 rollouts in flight, then
started again on the same file and port; the original lease tokens collect the 50 results
and 20 failures that name the killed process. Also the command's side: the default state
file, and the clear exit 2 for a state file it cannot use."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import sqlite3
import textwrap
from pathlib import Path
from typing import Any, Final

import aiohttp
import pytest

from rollout_types import LEASE_HEADER

from .cli_helpers import serve_target

COMMAND_LOOP_ONLY = True
"""Run these tests once (see conftest): the servers under test have their own loop."""

START_SEC: Final = 60.0
"""Bound on a subprocess's start-up (imports on a loaded 2-core machine)."""
EVENT_SEC: Final = 30.0
LISTENING: Final = re.compile(rb"listening on http://127\.0\.0\.1:(\d+)")
FINISHED: Final = 50
IN_FLIGHT: Final = 20

TARGET_MODULE: Final = '''
"""The backend of the restart tests: a rollout whose metadata says "hold" runs until the
process ends; any other answers at once and gets reward 1.0."""

import asyncio

from rollout_server import (
    AgentWorkflow,
    AgentWorkflowConfig,
    ConcurrencyConfig,
    Grader,
    LocalBackend,
)



class HoldingWorkflow(AgentWorkflow):
    async def run(self, ctx):
        if (ctx.metadata or {}).get("hold"):
            await asyncio.get_running_loop().create_future()
        return [*ctx.prompt, {"role": "assistant", "content": "42"}]


class FullMarks(Grader):
    async def grade(self, ctx):
        ctx.set_reward(1.0)


backend = LocalBackend(
    workflow=HoldingWorkflow,
    workflow_config=AgentWorkflowConfig(
        name="restart", concurrency=ConcurrencyConfig(max_concurrent=None)
    ),
    grader=FullMarks,
)
'''


@pytest.fixture(scope="module")
def app_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("restart-targets")
    (directory / "restart_targets.py").write_text(textwrap.dedent(TARGET_MODULE))
    return directory


def serve(app_dir: Path, *args: str, env: dict[str, str] | None = None) -> Any:
    """Serve ``restart_targets:backend`` with short shutdown stages (stopped by its PID)."""
    return serve_target(
        app_dir,
        "restart_targets:backend",
        *("--result-wait-timeout-sec", "1", "--drain-timeout-sec", "0"),
        *("--cleanup-timeout-sec", "1", "--collect-timeout-sec", "0"),
        *args,
        env=env,
    )


def init(rollout_id: str, *, hold: bool) -> dict[str, Any]:
    return {
        "initial_messages": [{"role": "user", "content": "6 x 7?"}],
        "rollout_id": rollout_id,
        "chat_completions_url": "http://127.0.0.1:9/v1",
        "metadata": {"hold": hold},
    }


async def admit(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str:
    async with session.post(f"{url}/rollout", json=body) as response:
        assert response.status == 202, await response.text()
        token: str = (await response.json())["polling_lease_token"]
        return token


async def health(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(f"{url}/health") as response:
        assert response.status == 200
        document: dict[str, Any] = await response.json()
        return document


async def poll(
    session: aiohttp.ClientSession, url: str, rollout_id: str, token: str
) -> tuple[int, Any]:
    async with session.get(
        f"{url}/rollout/{rollout_id}/result", headers={LEASE_HEADER: token}
    ) as response:
        return response.status, await response.json()


class TestSigkillRestart:
    async def test_original_tokens_collect_results_and_restart_failures(
        self, app_dir: Path, session: aiohttp.ClientSession, tmp_path: Path
    ) -> None:
        """50 finished-uncollected and 20 in-flight rollouts survive a SIGKILL: after the
        restart on the same file and port the original tokens collect 50 successes and 20
        failures / internal_error naming the killed process; a wrong token is 403, a
        recovered id 409, /health and the startup line give both counts."""
        state = f"sqlite://{tmp_path / 'state.db'}"
        tokens: dict[str, str] = {}
        with serve(app_dir, "--port", "0", "--state", state) as first:
            await first.listening()
            port = first.port
            for i in range(IN_FLIGHT):
                tokens[f"fly-{i}"] = await admit(session, first.url, init(f"fly-{i}", hold=True))
            for i in range(FINISHED):
                tokens[f"done-{i}"] = await admit(session, first.url, init(f"done-{i}", hold=False))
            # Every admission and every result is durable once the store has committed all
            # of them (results count as published only then): no poll collects one.
            writes = len(tokens) + FINISHED
            async with asyncio.timeout(EVENT_SEC):
                while True:
                    document = await health(session, first.url)
                    if (
                        document["state"]["writes"] >= writes
                        and document["lifecycle"]["active_rollouts"] == IN_FLIGHT
                    ):
                        break
                    await asyncio.sleep(0.05)
            killed_process_id = document["process_id"]
            assert document["state"]["store"] == "sqlite"
            first.process.send_signal(signal.SIGKILL)  # by its PID
            assert await first.exit_status() == -signal.SIGKILL

        with serve(app_dir, "--port", str(port), "--state", state) as second:
            await second.listening()
            assert second.port == port
            recovered = next(line for line in second.lines if b"recovered" in line).decode()
            assert (
                f"State {state}: recovered {FINISHED} rollout result(s); {IN_FLIGHT} rollout(s) "
                f"in flight failed by the restart (server process {killed_process_id} ended "
                "before they finished)"
            ) in recovered
            document = await health(session, second.url)
            assert document["process_id"] != killed_process_id
            assert document["lifecycle"] == {"accepting_rollouts": True, "active_rollouts": 0}
            assert document["state"]["recovered_rollouts"] == FINISHED
            assert document["state"]["failed_by_restart"] == IN_FLIGHT

            answers = await asyncio.gather(
                *(poll(session, second.url, rid, token) for rid, token in tokens.items())
            )
            by_id = dict(zip(tokens, answers, strict=True))
            for i in range(FINISHED):
                status, body = by_id[f"done-{i}"]
                assert status == 200
                assert body["status"] == "success"
                assert body["sample"]["reward"] == 1.0
            for i in range(IN_FLIGHT):
                status, body = by_id[f"fly-{i}"]
                assert status == 200
                assert body == {
                    "rollout_id": f"fly-{i}",
                    "status": "failure",
                    "sample": None,
                    "err_message": (
                        f"the server process {killed_process_id} ended before the rollout finished"
                    ),
                    "err_category": "internal_error",
                }
            status, _ = await poll(session, second.url, "done-0", tokens["fly-0"])
            assert status == 403
            async with session.post(f"{second.url}/rollout", json=init("done-0", hold=False)) as r:
                assert r.status == 409
            # A new rollout is admitted and served as usual.
            token = await admit(session, second.url, init("after", hold=False))
            async with asyncio.timeout(EVENT_SEC):
                while (await poll(session, second.url, "after", token))[1]["status"] != "success":
                    pass
            second.process.send_signal(signal.SIGTERM)
            assert await second.exit_status() == 0
        assert "State file" in second.output  # the close line, with the commit figures


class TestSigtermRestart:
    async def test_a_graceful_stop_keeps_what_its_shutdown_published(
        self, app_dir: Path, session: aiohttp.ClientSession, tmp_path: Path
    ) -> None:
        """After SIGTERM the staged shutdown has answered a running rollout (cancelled) and
        stored it: the restarted server serves that answer to the original token, and
        fails nothing by the restart."""
        state = f"sqlite://{tmp_path / 'state.db'}"
        with serve(app_dir, "--port", "0", "--state", state) as first:
            await first.listening()
            port = first.port
            held = await admit(session, first.url, init("held", hold=True))
            done = await admit(session, first.url, init("done", hold=False))
            async with asyncio.timeout(EVENT_SEC):
                document = await health(session, first.url)
                while document["lifecycle"]["active_rollouts"] != 1:
                    await asyncio.sleep(0.05)  # another process's state: polled
                    document = await health(session, first.url)
            first.process.send_signal(signal.SIGTERM)
            assert await first.exit_status() == 0
        with serve(app_dir, "--port", str(port), "--state", state) as second:
            await second.listening()
            document = await health(session, second.url)
            assert document["state"]["recovered_rollouts"] == 2
            assert document["state"]["failed_by_restart"] == 0
            status, body = await poll(session, second.url, "held", held)
            assert (status, body["status"], body["err_message"]) == (200, "cancelled", "cancelled")
            status, body = await poll(session, second.url, "done", done)
            assert (status, body["status"]) == (200, "success")


class TestCommandState:
    async def test_the_default_state_file_is_keyed_by_port_under_xdg_state_home(
        self, app_dir: Path, session: aiohttp.ClientSession, tmp_path: Path
    ) -> None:
        """Without --state, a fixed port keeps its state in
        $XDG_STATE_HOME/rollout/state/serve-PORT.db, named on the startup line."""
        with contextlib.closing(__import__("socket").socket()) as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        xdg = tmp_path / "xdg"
        with serve(app_dir, "--port", str(port), env={"XDG_STATE_HOME": str(xdg)}) as served:
            await served.listening()
            expected = xdg / "rollout" / "state" / f"serve-{port}.db"
            serving = next(line for line in served.lines if b"serving" in line).decode()
            assert f"state sqlite://{expected};" in serving
            assert expected.exists()
            await admit(session, served.url, init("r1", hold=False))
            served.process.send_signal(signal.SIGTERM)
            assert await served.exit_status() == 0

    async def test_port_0_keeps_no_state_and_says_so(self, app_dir: Path) -> None:
        with serve(app_dir, "--port", "0") as served:
            await served.listening()
            serving = next(line for line in served.lines if b"serving" in line).decode()
            assert "state memory: (nothing survives a restart; pass --state" in serving

    async def test_a_second_server_on_the_same_file_exits_2_naming_the_holder(
        self, app_dir: Path, tmp_path: Path
    ) -> None:
        state = f"sqlite://{tmp_path / 'shared.db'}"
        with serve(app_dir, "--port", "0", "--state", state) as first:
            await first.listening()
            with serve(app_dir, "--port", "0", "--state", state) as second:
                assert await second.exit_status() == 2
            errors = [line for line in second.lines if b"ERROR" in line]
        assert len(errors) == 1, second.output
        line = errors[0].decode()
        assert f"state file {tmp_path / 'shared.db'} is in use by another rollout-server" in line
        assert f"pid {first.process.pid} on " in line
        assert "Traceback" not in second.output

    @pytest.mark.parametrize(
        ("problem", "says"),
        [
            ("corrupt", "is not a readable rollout-server state file"),
            ("newer", "newer than this rollout-server's"),
            ("relative", "is not an absolute sqlite URL"),
        ],
    )
    async def test_a_state_file_it_cannot_use_exits_2_with_one_line(
        self, app_dir: Path, tmp_path: Path, problem: str, says: str
    ) -> None:
        path = tmp_path / f"{problem}.db"
        if problem == "corrupt":
            path.write_bytes(b"not a database at all " * 400)
        elif problem == "newer":
            with contextlib.closing(sqlite3.connect(path)) as db:
                db.execute("PRAGMA user_version = 99")
        state = "sqlite://relative.db" if problem == "relative" else f"sqlite://{path}"
        with serve(app_dir, "--port", "0", "--state", state) as served:
            assert await served.exit_status() == 2
        errors = [line for line in served.lines if b"ERROR" in line]
        assert len(errors) == 1, served.output
        assert says in errors[0].decode()
        assert "Traceback" not in served.output
