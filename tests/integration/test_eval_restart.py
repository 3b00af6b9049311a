"""rollout-eval across a server restart (issue 28, item 4): a real ``rollout-server serve`` on
a SQLite state file is SIGKILLed (by its PID) while a run has rollouts in flight, and started
again on the same port and file. The run rides out the outage (its polls keep the lease
tokens and retry the refused connections), records each rollout the restart failed once, as
an unscored infrastructure failure, does not stop although more of them failed than
``--max-consecutive-infra-failures`` allows (one restart counts once), and a resume runs
them again: every item ends with exactly one final outcome, none scored twice."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import aiohttp
import pytest

from rollout_client.eval import EvalOptions, read_journal, run_eval

START_SEC: Final = 60.0
"""Bound on a server's start-up (imports on a loaded 2-core machine)."""
EVENT_SEC: Final = 60.0
LISTENING: Final = re.compile(rb"listening on http://127\.0\.0\.1:(\d+)")
HELD: Final = 8
"""Rows that hold in the first server process (all in flight when it is killed)."""
QUICK: Final = 4

TARGET_MODULE: Final = '''
"""A rollout whose metadata says "hold" runs until the process ends while the variable
EVAL_RESTART_HOLD is 1; every other answers at once with reward 1.0."""

import asyncio
import os

from rollout_server import AgentWorkflow, AgentWorkflowConfig, ConcurrencyConfig, Grader
from rollout_server import LocalBackend


class HoldingWorkflow(AgentWorkflow):
    async def run(self, ctx):
        if (ctx.metadata or {}).get("hold") and os.environ["EVAL_RESTART_HOLD"] == "1":
            await asyncio.get_running_loop().create_future()
        return [*ctx.prompt, {"role": "assistant", "content": "42"}]


class FullMarks(Grader):
    async def grade(self, ctx):
        ctx.set_reward(1.0)


backend = LocalBackend(
    workflow=HoldingWorkflow,
    workflow_config=AgentWorkflowConfig(
        name="eval-restart", concurrency=ConcurrencyConfig(max_concurrent=None)
    ),
    grader=FullMarks,
)
'''


@contextlib.contextmanager
def serve(app_dir: Path, port: int, state: str, *, hold: bool) -> Iterator[subprocess.Popen[bytes]]:
    """Start ``rollout-server serve`` on 127.0.0.1; stop it by its PID at the end."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollout_server",
            "serve",
            "eval_restart_target:backend",
            "--app-dir",
            str(app_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--state",
            state,
            "--result-wait-timeout-sec",
            "1",
            "--drain-timeout-sec",
            "0",
            "--cleanup-timeout-sec",
            "1",
            "--collect-timeout-sec",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "EVAL_RESTART_HOLD": "1" if hold else "0"},
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=EVENT_SEC)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=EVENT_SEC)
        if process.stdout is not None:
            process.stdout.close()


async def listening_port(process: subprocess.Popen[bytes]) -> int:
    """Read the server's output (bounded) until it says where it listens."""
    loop = asyncio.get_running_loop()
    stream = process.stdout
    assert stream is not None
    seen: list[bytes] = []
    async with asyncio.timeout(START_SEC):
        while True:
            line = await loop.run_in_executor(None, stream.readline)
            if not line:
                pytest.fail("rollout-server exited early:\n" + b"".join(seen).decode())
            seen.append(line)
            if match := LISTENING.search(line):
                return int(match.group(1))


async def health(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/health") as response:
        assert response.status == 200
        document: dict[str, Any] = await response.json()
        return document


def dataset(path: Path) -> Path:
    rows = [
        {"user_prompt": f"row {index}", "label": "42", "metadata": {"hold": index < HELD}}
        for index in range(HELD + QUICK)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


class TestEvalAcrossServerRestart:
    async def test_a_sigkill_restart_mid_run_leaves_every_item_one_outcome(
        self, tmp_path: Path
    ) -> None:
        app_dir = tmp_path / "targets"
        app_dir.mkdir()
        (app_dir / "eval_restart_target.py").write_text(textwrap.dedent(TARGET_MODULE))
        state = f"sqlite://{tmp_path / 'state.db'}"
        stream = io.StringIO()
        with serve(app_dir, 0, state, hold=True) as first:
            port = await listening_port(first)
            url = f"http://127.0.0.1:{port}"
            options = EvalOptions(
                dataset=dataset(tmp_path / "rows.jsonl"),
                server_url=url,
                chat_url="http://127.0.0.1:9/v1",
                output=tmp_path / "out",
                name="restart",
                concurrency=HELD,
                progress="off",
            )
            run = asyncio.create_task(run_eval(options, stream=stream))
            # Kill once all held rollouts are admitted and stored (durable).
            async with asyncio.timeout(EVENT_SEC):
                while True:
                    document = await health(url)
                    if (
                        document["lifecycle"]["active_rollouts"] == HELD
                        and document["state"]["writes"] >= HELD
                    ):
                        break
                    await asyncio.sleep(0.05)
            killed = document["process_id"]
            first.send_signal(signal.SIGKILL)  # by its PID
            await asyncio.get_running_loop().run_in_executor(None, first.wait)
        with serve(app_dir, port, state, hold=False) as second:
            await listening_port(second)
            async with asyncio.timeout(EVENT_SEC):
                report = await run
            after = await health(url)
            assert after["state"]["failed_by_restart"] == HELD
            output = stream.getvalue()
            assert f"the rollout server restarted (process {killed} ended)" in output
            assert "consecutive infrastructure failures" not in output  # not stopped
            outcomes = {k: v for k, v in report.summary["by_outcome"].items() if v}
            assert outcomes == {"infra_failure": HELD, "success": QUICK}
            assert report.summary["complete"] is False

            journal = read_journal(report.run_dir / "events.jsonl")
            for record in journal:
                if record.outcome == "infra_failure":
                    assert record.row_index < HELD
                    assert record.err_category == "internal_error"
                    assert record.err_message == (
                        f"the server process {killed} ended before the rollout finished"
                    )
                    assert record.reward is None

            # The resume runs the pending (restart-failed) items again, on the new process.
            async with asyncio.timeout(EVENT_SEC):
                resumed = await run_eval(options, stream=io.StringIO())
            assert resumed.exit_code == 0
            assert resumed.summary["complete"] is True
            outcomes = {k: v for k, v in resumed.summary["by_outcome"].items() if v}
            assert outcomes == {"success": HELD + QUICK}

        records: defaultdict[int, list[str]] = defaultdict(list)
        for record in read_journal(report.run_dir / "events.jsonl"):
            records[record.row_index].append(record.outcome)
        assert records == {
            **{row: ["infra_failure", "success"] for row in range(HELD)},
            **{row: ["success"] for row in range(HELD, HELD + QUICK)},
        }

    async def test_with_two_servers_the_restarted_one_fails_only_what_it_held(
        self, tmp_path: Path
    ) -> None:
        """Two servers through the pool: server A holds what it gets, B answers at once. A
        is SIGKILLed with rollouts in flight and restarted on its port and file: the run
        goes on (B takes the admissions meanwhile), the rollouts A held end once each as
        restart failures, the resume completes every item, none scored twice."""
        app_dir = tmp_path / "targets"
        app_dir.mkdir()
        (app_dir / "eval_restart_target.py").write_text(textwrap.dedent(TARGET_MODULE))
        state_a = f"sqlite://{tmp_path / 'a.db'}"
        state_b = f"sqlite://{tmp_path / 'b.db'}"
        items = HELD + QUICK
        stream = io.StringIO()
        with (
            serve(app_dir, 0, state_a, hold=True) as first_a,
            serve(app_dir, 0, state_b, hold=False) as server_b,
        ):
            port_a = await listening_port(first_a)
            port_b = await listening_port(server_b)
            url_a, url_b = f"http://127.0.0.1:{port_a}", f"http://127.0.0.1:{port_b}"
            options = EvalOptions(
                dataset=dataset(tmp_path / "rows.jsonl"),
                server_url=url_a,
                extra_server_urls=(url_b,),
                chat_url="http://127.0.0.1:9/v1",
                output=tmp_path / "out",
                name="pool-restart",
                concurrency=4,
                progress="off",
            )
            run = asyncio.create_task(run_eval(options, stream=stream))
            # Kill A once it holds a stored rollout (it never finishes one).
            async with asyncio.timeout(EVENT_SEC):
                while True:
                    document = await health(url_a)
                    active = document["lifecycle"]["active_rollouts"]
                    if active >= 1 and document["state"]["writes"] >= active:
                        break
                    await asyncio.sleep(0.05)
            killed = document["process_id"]
            first_a.send_signal(signal.SIGKILL)  # by its PID
            await asyncio.get_running_loop().run_in_executor(None, first_a.wait)
            with serve(app_dir, port_a, state_a, hold=False) as second_a:
                await listening_port(second_a)
                async with asyncio.timeout(EVENT_SEC):
                    report = await run
                failed_by_restart = (await health(url_a))["state"]["failed_by_restart"]
                assert failed_by_restart >= 1
                journal = read_journal(report.run_dir / "events.jsonl")
                restart_failures = [r for r in journal if r.outcome == "infra_failure"]
                # Every rollout A held and the run polled ends once as a restart failure (an
                # admission cut off by the kill may leave an orphan A fails but nobody polls).
                assert 1 <= len(restart_failures) <= failed_by_restart
                for record in restart_failures:
                    assert record.err_category == "internal_error"
                    assert record.err_message == (
                        f"the server process {killed} ended before the rollout finished"
                    )
                assert "consecutive infrastructure failures" not in stream.getvalue()
                assert report.summary["items"]["pending"] == len(restart_failures)

                async with asyncio.timeout(EVENT_SEC):
                    resumed = await run_eval(options, stream=io.StringIO())
                assert resumed.exit_code == 0
                assert resumed.summary["complete"] is True

        finals: defaultdict[int, list[str]] = defaultdict(list)
        for record in read_journal(report.run_dir / "events.jsonl"):
            if record.outcome != "infra_failure":
                finals[record.row_index].append(record.outcome)
        assert finals == {row: ["success"] for row in range(items)}
