"""The ``rollout-server`` command as a process: signals, the staged shutdown's bounds, exit
statuses and what it prints (each test starts its own server and stops it by its PID)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import socket
import subprocess
from pathlib import Path

import aiohttp
import pytest

from rollout_types import LEASE_HEADER

from .cli_helpers import (
    EVENT_SEC,
    EXIT_SEC,
    LISTENING,
    START_SEC,
    server_process,
    write_targets,
)

COMMAND_LOOP_ONLY = True
"""Run these tests once, on uvloop (see conftest): the servers under test have their own loop."""


@pytest.fixture(scope="module")
def app_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding ``cli_targets.py``, the module the tests serve from."""
    return write_targets(tmp_path_factory.mktemp("targets"))


class OutputReader:
    """Reads a subprocess's merged output line by line on the event loop."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process
        self.lines: list[bytes] = []

    async def until(self, pattern: re.Pattern[bytes], timeout: float) -> re.Match[bytes]:
        """Read lines until one matches ``pattern`` (bounded); fail on exit."""
        loop = asyncio.get_running_loop()
        stream = self.process.stdout
        assert stream is not None
        async with asyncio.timeout(timeout):
            while True:
                line = await loop.run_in_executor(None, stream.readline)
                if not line:
                    pytest.fail(f"server exited early:\n{b''.join(self.lines).decode()}")
                self.lines.append(line)
                if match := pattern.search(line):
                    return match

    async def rest(self) -> bytes:
        """The remaining output once the process has exited."""
        loop = asyncio.get_running_loop()
        stream = self.process.stdout
        assert stream is not None
        self.lines.append(await loop.run_in_executor(None, stream.read))
        return b"".join(self.lines)


def stubborn_server(
    app_dir: Path, artifacts: Path, *, stage_sec: str, target: str = "cli_targets:stubborn"
) -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    """Serve ``target`` (default ``cli_targets:stubborn``, whose workflow swallows every
    cancellation), with a 0.2 s drain and every later shutdown stage ``stage_sec`` long."""
    stages = ("--cleanup", "--force", "--backend-shutdown", "--collect")
    return server_process(
        app_dir,
        target,
        *("--port", "0", "--result-wait-timeout-sec", "0.2", "--drain-timeout-sec", "0.2"),
        *(arg for stage in stages for arg in (f"{stage}-timeout-sec", stage_sec)),
        env={"ROLLOUT_ARTIFACT_ROOT": str(artifacts)},
    )


async def admit_and_wait_running(
    session: aiohttp.ClientSession, base: str, rollout_id: str
) -> None:
    """Admit ``rollout_id`` and long-poll (bounded) until it is running."""
    body = {"initial_messages": [], "rollout_id": rollout_id, "chat_completions_url": ""}
    async with session.post(f"{base}/rollout", json=body) as response:
        assert response.status == 202
        token = (await response.json())["polling_lease_token"]
    async with asyncio.timeout(EVENT_SEC):
        while True:
            async with session.get(
                f"{base}/rollout/{rollout_id}/result", headers={LEASE_HEADER: token}
            ) as response:
                if (await response.json())["status"] == "running":
                    return


async def exit_status(
    process: subprocess.Popen[bytes], output: OutputReader, timeout: float
) -> int:
    """Wait (bounded) for ``process`` to exit; kill it by PID and fail if it does not."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout):
            return await loop.run_in_executor(None, process.wait)
    except TimeoutError:
        process.kill()
        await loop.run_in_executor(None, process.wait)
        pytest.fail(f"the process did not exit:\n{(await output.rest()).decode()}")


class TestSubprocess:
    @pytest.mark.parametrize(
        ("signum", "server_loop"), [(signal.SIGTERM, "auto"), (signal.SIGINT, "asyncio")]
    )
    async def test_signal_mid_rollout_drains_and_exits_0(
        self,
        app_dir: Path,
        session: aiohttp.ClientSession,
        signum: signal.Signals,
        server_loop: str,
    ) -> None:
        """SIGTERM (on uvloop) or SIGINT (on asyncio) closes admissions (503) while the running
        rollout's result, published by the drain, is still collected over HTTP; then the
        process exits 0."""
        with server_process(
            app_dir,
            "cli_targets:backend",
            "--loop",
            server_loop,
            "--port",
            "0",
            "--api-key-env",
            "CLI_TEST_KEY",
            "--result-wait-timeout-sec",
            "0.2",
            "--drain-timeout-sec",
            "0.2",
            "--collect-timeout-sec",
            "30",
            env={"CLI_TEST_KEY": "k-123"},
        ) as process:
            output = OutputReader(process)
            port = int((await output.until(LISTENING, START_SEC)).group(1))
            base = f"http://127.0.0.1:{port}"
            auth = {"Authorization": "Bearer k-123"}
            body = {"initial_messages": [], "rollout_id": "r1", "chat_completions_url": ""}
            async with session.post(f"{base}/rollout", json=body, headers=auth) as response:
                assert response.status == 202
                token = (await response.json())["polling_lease_token"]
            poll_headers = {**auth, LEASE_HEADER: token}
            async with session.get(f"{base}/rollout/r1/result", headers=poll_headers) as response:
                assert (await response.json())["status"] == "running"

            process.send_signal(signum)
            async with asyncio.timeout(EVENT_SEC):
                while True:
                    async with session.get(f"{base}/health", headers=auth) as response:
                        if not (await response.json())["lifecycle"]["accepting_rollouts"]:
                            break
                async with session.post(
                    f"{base}/rollout", json={**body, "rollout_id": "r2"}, headers=auth
                ) as response:
                    assert response.status == 503
                while True:
                    async with session.get(
                        f"{base}/rollout/r1/result", headers=poll_headers
                    ) as response:
                        assert response.status == 200
                        result = await response.json()
                    if result["status"] != "running":
                        break
            assert (result["status"], result["err_message"]) == ("cancelled", "cancelled")

            loop = asyncio.get_running_loop()
            try:
                async with asyncio.timeout(EVENT_SEC):
                    code = await loop.run_in_executor(None, process.wait)
            except TimeoutError:
                process.kill()
                pytest.fail(f"no exit after the drain:\n{(await output.rest()).decode()}")
            text = (await output.rest()).decode()
            assert code == 0, text
            assert f"Received {signum.name}" in text
            listening = next(line for line in output.lines if LISTENING.search(line))
            assert listening.rstrip().endswith(
                b"(uvloop)" if server_loop == "auto" else b"(asyncio)"
            )
            assert "Rollout server shutdown complete" in text

    async def test_bad_target_exits_2_with_a_message(self, app_dir: Path) -> None:
        """A target that cannot be served exits 2 with one clear error line."""
        with server_process(app_dir, "cli_targets:not_a_target", "--port", "0") as process:
            loop = asyncio.get_running_loop()
            async with asyncio.timeout(START_SEC):
                code = await loop.run_in_executor(None, process.wait)
            assert process.stdout is not None
            text = process.stdout.read().decode()
        assert code == 2
        assert "is a int, not an aiohttp app" in text
        assert "Traceback" not in text

    async def test_port_in_use_exits_1(self, app_dir: Path) -> None:
        """A port that is already taken makes the command exit 1 with the address logged."""
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            with server_process(app_dir, "cli_targets:backend", "--port", str(port)) as process:
                loop = asyncio.get_running_loop()
                async with asyncio.timeout(START_SEC):
                    code = await loop.run_in_executor(None, process.wait)
                assert process.stdout is not None
                text = process.stdout.read().decode()
        assert code == 1, text
        assert f"could not listen on http://127.0.0.1:{port}" in text
        lines = text.splitlines()
        first_failure = next(i for i, line in enumerate(lines) if "could not listen" in line)
        shutdown_lines = [i for i, line in enumerate(lines) if "shut" in line.lower()]
        assert all(i > first_failure for i in shutdown_lines), text

    async def test_work_that_swallows_cancellation_is_abandoned_and_the_process_exits_0(
        self, app_dir: Path, tmp_path: Path, session: aiohttp.ClientSession
    ) -> None:
        """A workflow that swallows every cancellation cannot keep the process alive: after
        the last stage its rollout is abandoned, its id logged once, and the process exits
        0 (bounded wait; killed by PID if it hangs)."""
        with stubborn_server(app_dir, tmp_path, stage_sec="1") as process:
            output = OutputReader(process)
            port = int((await output.until(LISTENING, START_SEC)).group(1))
            serving = next(line for line in output.lines if b"serving" in line).decode()
            assert (
                "rollout-server serving cli_targets:stubborn: backend LocalBackend (4 slot(s), "
                f"queue bound 8, artifact root {tmp_path}); auth off; state memory: (nothing "
                "survives a restart; pass --state sqlite:///ABS/PATH.db to keep it); protocol "
            ) in serving
            assert serving.rstrip().endswith("; loop uvloop")
            base = f"http://127.0.0.1:{port}"
            await admit_and_wait_running(session, base, "stuck-1")
            process.send_signal(signal.SIGTERM)
            code = await exit_status(process, output, EXIT_SEC)
            text = (await output.rest()).decode()
        assert code == 0, text
        abandoned = [line for line in text.splitlines() if "stuck-1" in line and "abandon" in line]
        assert len(abandoned) == 1, text
        assert "ignored forced cancellation; abandoning them: stuck-1" in abandoned[0]
        assert "task(s) still running after the shutdown ignored cancellation" in text

    async def test_a_second_signal_cuts_the_waits_short_and_exits_0(
        self, app_dir: Path, tmp_path: Path, session: aiohttp.ClientSession
    ) -> None:
        """With long stages and a workflow that swallows cancellation, a second SIGTERM ends
        the waits: the process exits 0 (not 143), logging the operator's cut and the
        abandoned rollout, with no ERROR line."""
        with stubborn_server(app_dir, tmp_path, stage_sec="600") as process:
            output = OutputReader(process)
            port = int((await output.until(LISTENING, START_SEC)).group(1))
            await admit_and_wait_running(session, f"http://127.0.0.1:{port}", "stuck-2")
            process.send_signal(signal.SIGTERM)
            await output.until(re.compile(rb"Cancelling 1 rollout\(s\)"), EVENT_SEC)
            process.send_signal(signal.SIGTERM)
            code = await exit_status(process, output, EXIT_SEC)
            text = (await output.rest()).decode()
        assert code == 0, text
        assert "Received SIGTERM again: cutting the shutdown waits short" in text
        assert (
            "Shutdown waits cut short by a second signal; abandoning 1 rollout execution(s) "
            "still running: stuck-2"
        ) in text
        assert " ERROR " not in text, text

    async def test_a_signal_after_the_stages_exits_0_at_once(
        self, app_dir: Path, tmp_path: Path, session: aiohttp.ClientSession
    ) -> None:
        """Once the shutdown is complete, a process held by a worker thread of user code that
        never returns exits 0 at once on another SIGTERM (not 143)."""
        target = "cli_targets:threaded"
        with stubborn_server(app_dir, tmp_path, stage_sec="1", target=target) as process:
            output = OutputReader(process)
            port = int((await output.until(LISTENING, START_SEC)).group(1))
            await admit_and_wait_running(session, f"http://127.0.0.1:{port}", "threaded-1")
            process.send_signal(signal.SIGTERM)
            await output.until(re.compile(rb"Rollout server shutdown complete"), EXIT_SEC)
            process.send_signal(signal.SIGTERM)
            code = await exit_status(process, output, EXIT_SEC)
            text = (await output.rest()).decode()
        assert code == 0, text
        # "Received SIGTERM again: exiting now", or, if the signal came while the listeners
        # were still closing, the exit bound's "... after the signal; exiting now".
        assert "exiting now" in text, text

    async def test_results_finished_before_the_signal_get_the_collect_window(
        self, app_dir: Path, session: aiohttp.ClientSession
    ) -> None:
        """Results published and not yet delivered when SIGTERM arrives count towards the
        collect window: every poll sent after the signal gets its result, then the process
        exits 0 (the window ends early once all are delivered)."""
        with server_process(
            app_dir,
            "cli_targets:quick",
            *("--port", "0", "--collect-timeout-sec", "600", "--api-key-env", "CLI_TEST_KEY"),
            env={"CLI_TEST_KEY": "k-123"},
        ) as process:
            output = OutputReader(process)
            port = int((await output.until(LISTENING, START_SEC)).group(1))
            serving = next(line for line in output.lines if b"serving" in line).decode()
            assert "rollout-server serving cli_targets:quick: backend QuickBackend; auth on;" in (
                serving
            )
            base = f"http://127.0.0.1:{port}"
            auth = {"Authorization": "Bearer k-123"}
            tokens = {}
            for index in range(5):
                rollout_id = f"done-{index}"
                body = {
                    "initial_messages": [],
                    "rollout_id": rollout_id,
                    "chat_completions_url": "",
                }
                async with session.post(f"{base}/rollout", json=body, headers=auth) as response:
                    assert response.status == 202
                    tokens[rollout_id] = (await response.json())["polling_lease_token"]
            async with asyncio.timeout(EVENT_SEC):
                while True:
                    async with session.get(f"{base}/health", headers=auth) as response:
                        if (await response.json())["lifecycle"]["active_rollouts"] == 0:
                            break
            process.send_signal(signal.SIGTERM)
            await output.until(re.compile(rb"collect 5 result\(s\)"), EVENT_SEC)
            for rollout_id, token in tokens.items():
                headers = {**auth, LEASE_HEADER: token}
                async with session.get(f"{base}/rollout/{rollout_id}/result", headers=headers) as (
                    response
                ):
                    assert response.status == 200
                    assert (await response.json())["status"] == "success"
            code = await exit_status(process, output, EXIT_SEC)
            text = (await output.rest()).decode()
        assert code == 0, text
