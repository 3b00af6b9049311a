"""The ``rollout-server`` command in process: targets, options, serving and the collector."""

from __future__ import annotations

import asyncio
import gc
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

import rollout_server
from rollout_server import ROLLOUT_SERVER_KEY, ModelGateway, ServerConfigError, ServeTargetError
from rollout_server.cli._cli import main
from rollout_server.cli._options import build_parser
from rollout_server.cli._serve import GC_YOUNG_THRESHOLD, LISTEN_BACKLOG, serve, tune_collector
from rollout_server.cli._target import build_app, load_target
from rollout_types import PROTOCOL_VERSION

from .cli_helpers import (
    EVENT_SEC,
    write_targets,
)

COMMAND_LOOP_ONLY = True
"""Run these tests once, on uvloop (see conftest): the servers under test have their own loop."""


@pytest.fixture(scope="module")
def app_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding ``cli_targets.py``, the module the tests serve from."""
    return write_targets(tmp_path_factory.mktemp("targets"))


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
            "--header-read-timeout-sec",
            "--body-read-timeout-sec",
            "--status-change-grace-sec",
            "--max-body-bytes",
            "--access-log",
            "--drain-timeout-sec",
            "--cleanup-timeout-sec",
            "--force-timeout-sec",
            "--backend-shutdown-timeout-sec",
            "--collect-timeout-sec",
            "--no-metrics",
            "--gateway",
            "--model-endpoint",
        ):
            assert flag in text
        assert "MODULE:ATTR" in text
        flat = " ".join(text.split())
        assert "connection is closed; idle keep-alive connections are not timed (default 30)" in (
            flat
        )
        assert "else 408 and the connection is closed (default 60)" in flat
        assert "at most 8190 bytes, so a rollout_id may be at most 8161 characters" in flat
        assert (
            "(default $_OSMOSIS_ROLLOUT_PORT when set, else 8000; osmosis-ai sets that variable "
            "to the port it expects when it launches a rollout server"
        ) in flat

    def test_there_is_no_api_key_option(self) -> None:
        """The key itself can never be passed on the command line."""
        with pytest.raises(SystemExit):
            parse("m:a", "--api-key", "secret")


class TestCommandLine:
    def test_version(self, capsys: pytest.CaptureFixture[str]) -> None:
        """--version prints the distribution's version and the protocol version, exit 0."""
        with pytest.raises(SystemExit) as info:
            main(["--version"])
        assert info.value.code == 0
        assert capsys.readouterr().out == (
            f"rollout-server {rollout_server.__version__} (rollout protocol {PROTOCOL_VERSION})\n"
        )

    def test_bad_option_prints_the_subcommand_usage(
        self, app_dir: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """An unknown option of serve exits 2 with serve's usage, not the top-level one."""
        with pytest.raises(SystemExit) as info:
            main(["serve", "cli_targets:backend", "--app-dir", str(app_dir), "--bogus", "1"])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("usage: rollout-server serve ")
        assert "rollout-server serve: error: unrecognized arguments: --bogus 1" in err

    @pytest.mark.parametrize("kind", ["missing", "file"])
    def test_app_dir_must_be_a_directory(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
    ) -> None:
        """An --app-dir that does not exist (or is a file) exits 2 and says so."""
        path = tmp_path / "nowhere"
        if kind == "file":
            path.write_text("")
        with pytest.raises(SystemExit) as info:
            main(["serve", "cli_targets:backend", "--app-dir", str(path)])
        assert info.value.code == 2
        problem = "does not exist" if kind == "missing" else "is not a directory"
        assert capsys.readouterr().err == (
            f"rollout-server serve: error: --app-dir {path} {problem}; pass the directory that "
            "holds MODULE (the default is the current directory)\n"
            "See 'rollout-server serve --help' for the options.\n"
        )

    def test_a_port_out_of_range_is_one_line(
        self, app_dir: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A --port outside 0-65535 exits 2 with one line and the --help hint, no usage."""
        with pytest.raises(SystemExit) as info:
            main(["serve", "cli_targets:backend", "--app-dir", str(app_dir), "--port", "70000"])
        assert info.value.code == 2
        assert capsys.readouterr().err == (
            "rollout-server serve: error: --port must be between 0 and 65535; got 70000\n"
            "See 'rollout-server serve --help' for the options.\n"
        )


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

    async def test_gateway_options(self, app_dir: Path) -> None:
        """--gateway runs a model gateway; each --model-endpoint is one of its endpoints;
        neither: no gateway."""
        target = load_target("cli_targets:backend", app_dir=str(app_dir))
        plain = (await build_app(target, parse("cli_targets:backend")))[ROLLOUT_SERVER_KEY]
        assert plain.model_router is None
        on = (await build_app(target, parse("cli_targets:backend", "--gateway")))[
            ROLLOUT_SERVER_KEY
        ]
        assert isinstance(on.model_router, ModelGateway)
        assert on.model_router.endpoints == ()
        args = parse(
            "cli_targets:backend",
            "--model-endpoint",
            "http://127.0.0.1:8001/v1/",
            "--model-endpoint",
            "http://127.0.0.1:8002/v1",
        )
        server = (await build_app(target, args))[ROLLOUT_SERVER_KEY]
        assert isinstance(server.model_router, ModelGateway)
        assert server.model_router.endpoints == (
            "http://127.0.0.1:8001/v1",
            "http://127.0.0.1:8002/v1",
        )
        with pytest.raises(ServerConfigError, match="not an http"):
            await build_app(target, parse("cli_targets:backend", "--model-endpoint", "8001"))
        with pytest.raises(ServeTargetError, match="--gateway"):
            await build_app(
                load_target("cli_targets:app", app_dir=str(app_dir)),
                parse("cli_targets:app", "--gateway"),
            )

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

    async def test_the_listening_socket_has_a_deep_accept_queue(
        self, app_dir: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """serve() listens with a backlog of LISTEN_BACKLOG (4096), not aiohttp's 128, which
        drops connections when thousands of callers open long polls at once."""
        loop = asyncio.get_running_loop()
        backlogs: list[object] = []
        listening = asyncio.Event()
        create_server = loop.create_server

        async def recording_create_server(*args: Any, **kwargs: Any) -> asyncio.Server:
            backlogs.append(kwargs.get("backlog"))
            server = await create_server(*args, **kwargs)
            listening.set()
            return server

        monkeypatch.setattr(loop, "create_server", recording_create_server)
        target = load_target("cli_targets:factory", app_dir=str(app_dir))
        app = await build_app(target, parse("cli_targets:factory", "--drain-timeout-sec", "0"))
        stop = asyncio.Event()
        task = asyncio.create_task(serve(app, host="127.0.0.1", port=0, stop=stop))
        async with asyncio.timeout(EVENT_SEC):
            await listening.wait()
        stop.set()
        async with asyncio.timeout(EVENT_SEC):
            await task
        assert backlogs == [LISTEN_BACKLOG] == [4096]

    async def test_the_signal_handlers_found_at_the_start_are_back_at_the_end(
        self, app_dir: Path
    ) -> None:
        """serve() hands SIGTERM and SIGINT back to the handlers it found, not to the default
        action, which would end the process on a signal sent as the server stops listening
        (the command's exit guard waits there)."""

        def found(_signum: int, _frame: object) -> None:
            """The handler installed before serving."""

        saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
        try:
            for signum in saved:
                signal.signal(signum, found)
            target = load_target("cli_targets:factory", app_dir=str(app_dir))
            app = await build_app(target, parse("cli_targets:factory", "--drain-timeout-sec", "0"))
            stop = asyncio.Event()
            stop.set()
            async with asyncio.timeout(EVENT_SEC):
                await serve(app, host="127.0.0.1", port=0, stop=stop)
            assert {signum: signal.getsignal(signum) for signum in saved} == dict.fromkeys(
                saved, found
            )
        finally:
            for signum, handler in saved.items():
                signal.signal(signum, handler)


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
