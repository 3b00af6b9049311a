"""The ``rollout-server`` command: targets, options, serving, and SIGTERM in a subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from rollout_server import ROLLOUT_SERVER_KEY, ServerConfigError, ServeTargetError
from rollout_server._cli import (
    GC_YOUNG_THRESHOLD,
    build_app,
    build_parser,
    load_target,
    serve,
    tune_collector,
)
from rollout_types import LEASE_HEADER

COMMAND_LOOP_ONLY = True
"""Run these tests once, on uvloop (see conftest): the servers under test have their own loop."""

EVENT_SEC = 10.0
START_SEC = 60.0
"""Bound on a subprocess's start-up (imports on a loaded 2-core machine)."""
LISTENING = re.compile(rb"listening on http://127\.0\.0\.1:(\d+)")

TARGET_MODULE = '''
"""Serve targets for the tests of ``rollout-server serve``."""

import asyncio

from rollout_server import ExecutionBackend, create_rollout_server


class WaitingBackend(ExecutionBackend):
    """Every execution waits until it is cancelled."""

    async def execute(self, request):
        await asyncio.get_running_loop().create_future()


backend = WaitingBackend()
app = create_rollout_server(backend=WaitingBackend())
not_a_target = 42


def factory():
    return WaitingBackend()


async def async_factory():
    return create_rollout_server(backend=WaitingBackend())


def broken_factory():
    raise RuntimeError("factory broke")
'''


@pytest.fixture(scope="module")
def app_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding ``cli_targets.py``, the module the tests serve from."""
    directory = tmp_path_factory.mktemp("targets")
    (directory / "cli_targets.py").write_text(textwrap.dedent(TARGET_MODULE))
    return directory


def parse(*argv: str) -> Any:
    """Parse ``rollout-server serve ...``."""
    return build_parser().parse_args(["serve", *argv])


class TestOptions:
    def test_help_documents_every_option(self, capsys: pytest.CaptureFixture[str]) -> None:
        """``serve --help`` names every option of the command."""
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args(["serve", "--help"])
        assert info.value.code == 0
        text = capsys.readouterr().out
        for flag in (
            "--host",
            "--port",
            "--port-file",
            "--app-dir",
            "--loop",
            "--log-level",
            "--api-key-env",
            "--result-wait-timeout-sec",
            "--polling-lease-timeout-sec",
            "--result-retention-sec",
            "--keepalive-timeout-sec",
            "--status-change-grace-sec",
            "--max-body-bytes",
            "--access-log",
            "--drain-timeout-sec",
            "--cleanup-timeout-sec",
            "--force-timeout-sec",
            "--backend-shutdown-timeout-sec",
            "--collect-timeout-sec",
        ):
            assert flag in text
        assert "MODULE:ATTR" in text

    def test_there_is_no_api_key_option(self) -> None:
        """The key itself can never be passed on the command line."""
        with pytest.raises(SystemExit):
            parse("m:a", "--api-key", "secret")


class TestTargets:
    @pytest.mark.parametrize("spec", ["nocolon", ":attr", "module:"])
    def test_malformed_target(self, spec: str) -> None:
        """A target without MODULE:ATTR form is refused with an example."""
        with pytest.raises(ServeTargetError, match="MODULE:ATTR"):
            load_target(spec, app_dir=None)

    def test_missing_module_and_attribute(self, app_dir: Path) -> None:
        """An unknown module or attribute is named in the error."""
        with pytest.raises(ServeTargetError, match="cannot import module 'no_such_mod'"):
            load_target("no_such_mod:x", app_dir=str(app_dir))
        with pytest.raises(ServeTargetError, match="has no attribute 'nope'"):
            load_target("cli_targets:nope", app_dir=str(app_dir))

    def test_a_missing_module_points_at_app_dir(self, app_dir: Path) -> None:
        """The error for a missing module says where it was looked for and to pass
        --app-dir."""
        with pytest.raises(
            ServeTargetError,
            match=r"it is not in --app-dir \(.+\) or on sys\.path; check the spelling, or "
            r"pass --app-dir$",
        ):
            load_target("no_such_mod:x", app_dir=str(app_dir))

    def test_a_module_failing_at_import(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A module whose own code raises while imported is a ServeTargetError naming the
        error and chained to it (so the command shows its traceback)."""
        (tmp_path / "cli_broken_target.py").write_text("raise RuntimeError('boom')\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        with pytest.raises(
            ServeTargetError,
            match=r"importing module 'cli_broken_target' named by target "
            r"'cli_broken_target:x' failed: RuntimeError: boom",
        ) as info:
            load_target("cli_broken_target:x", app_dir=str(tmp_path))
        assert isinstance(info.value.__cause__, RuntimeError)

    @pytest.mark.parametrize("attr", ["backend", "app", "factory", "async_factory"])
    async def test_accepted_kinds_become_rollout_apps(self, app_dir: Path, attr: str) -> None:
        """An app, a backend, and sync or async factories of either all serve."""
        target = load_target(f"cli_targets:{attr}", app_dir=str(app_dir))
        app = await build_app(target, parse(f"cli_targets:{attr}"))
        assert ROLLOUT_SERVER_KEY in app

    async def test_options_configure_a_backend_target(self, app_dir: Path) -> None:
        """Timing options reach the server built from a backend."""
        target = load_target("cli_targets:backend", app_dir=str(app_dir))
        args = parse(
            "cli_targets:backend",
            "--result-wait-timeout-sec",
            "2",
            "--polling-lease-timeout-sec",
            "9",
            "--drain-timeout-sec",
            "0.5",
            "--status-change-grace-sec",
            "0",
        )
        server = (await build_app(target, args))[ROLLOUT_SERVER_KEY]
        assert (server.result_wait_timeout_sec, server.polling_lease_timeout_sec) == (2.0, 9.0)
        assert server.shutdown_timeouts.drain_sec == 0.5
        assert server.status_change_grace_sec == 0.0

    async def test_options_with_a_built_app_are_refused(self, app_dir: Path) -> None:
        """Server options cannot silently be ignored for an app that is built already."""
        target = load_target("cli_targets:app", app_dir=str(app_dir))
        with pytest.raises(ServeTargetError, match="--result-wait-timeout-sec"):
            await build_app(target, parse("cli_targets:app", "--result-wait-timeout-sec", "2"))

    @pytest.mark.parametrize(
        ("attr", "message"),
        [("not_a_target", "is a int"), ("broken_factory", "factory broke")],
    )
    async def test_bad_targets(self, app_dir: Path, attr: str, message: str) -> None:
        """A target of the wrong kind, or a failing factory, raises ServeTargetError."""
        target = load_target(f"cli_targets:{attr}", app_dir=str(app_dir))
        with pytest.raises(ServeTargetError, match=message):
            await build_app(target, parse(f"cli_targets:{attr}"))

    async def test_plain_aiohttp_app_is_refused(self) -> None:
        """An aiohttp app not built by create_rollout_server() is refused."""
        with pytest.raises(ServeTargetError, match="did not build"):
            await build_app(web.Application(), parse("m:a"))

    async def test_api_key_comes_from_the_named_variable(
        self, app_dir: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """--api-key-env reads the key from that variable, and refuses an unset one."""
        target = load_target("cli_targets:backend", app_dir=str(app_dir))
        monkeypatch.delenv("CLI_TEST_KEY", raising=False)
        with pytest.raises(ServerConfigError, match="CLI_TEST_KEY"):
            await build_app(target, parse("cli_targets:backend", "--api-key-env", "CLI_TEST_KEY"))
        monkeypatch.setenv("CLI_TEST_KEY", "k-123")
        app = await build_app(target, parse("cli_targets:backend", "--api-key-env", "CLI_TEST_KEY"))
        assert ROLLOUT_SERVER_KEY in app


class TestServe:
    async def test_port_zero_port_file_and_stop(
        self, app_dir: Path, tmp_path: Path, session: aiohttp.ClientSession
    ) -> None:
        """With port 0 the bound port is written to --port-file; setting stop drains the
        server, stops it and removes the file."""
        target = load_target("cli_targets:factory", app_dir=str(app_dir))
        app = await build_app(target, parse("cli_targets:factory", "--drain-timeout-sec", "0"))
        port_file = tmp_path / "port"
        stop = asyncio.Event()
        task = asyncio.create_task(
            serve(app, host="127.0.0.1", port=0, port_file=port_file, stop=stop)
        )
        async with asyncio.timeout(EVENT_SEC):
            while not port_file.exists():  # noqa: ASYNC110 - a file has no event to await
                await asyncio.sleep(0.01)
        port = int(port_file.read_text())
        async with session.get(f"http://127.0.0.1:{port}/health") as response:
            assert response.status == 200
        stop.set()
        async with asyncio.timeout(EVENT_SEC):
            await task
        assert not port_file.exists()
        assert not app[ROLLOUT_SERVER_KEY].accepting_rollouts


@contextlib.contextmanager
def server_process(
    app_dir: Path, *args: str, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """Start ``python -m rollout_server serve ...``; stop it by its PID at the end."""
    process = subprocess.Popen(
        [sys.executable, "-m", "rollout_server", "serve", *args, "--app-dir", str(app_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
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


class TestCollector:
    def test_serving_freezes_what_lives_and_collects_the_young_less_often(self) -> None:
        """tune_collector() freezes the objects alive now and sets only the young
        generation's threshold to GC_YOUNG_THRESHOLD."""
        before = gc.get_threshold()
        frozen_before = gc.get_freeze_count()
        try:
            tune_collector()
            assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, *before[1:])
            assert gc.get_freeze_count() > frozen_before
        finally:
            gc.set_threshold(*before)
            gc.unfreeze()


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


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    """An aiohttp client session for talking to a served subprocess."""
    async with aiohttp.ClientSession() as client_session:
        yield client_session


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
