"""The rollout-eval command line: options, errors, exit statuses and closing lines."""

from __future__ import annotations

import asyncio
import gc
import io
import json
import logging
import os
import re
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

import pytest
from aiohttp import web

import rollout_client
from rollout_client.eval._cli import (
    GC_YOUNG_THRESHOLD,
    build_parser,
    collector_tuned,
    main,
    options_from_args,
)
from rollout_client.eval._keys import describe_key
from rollout_types import PROTOCOL_VERSION

from .conftest import RolloutScript, result_fields, write_dataset

PROCESS_SEC = 60.0
"""Bound on one rollout-eval process (start-up included, on a loaded 2-core machine)."""


def run_args(dataset: Path, *extra: str) -> list[str]:
    return [
        "run",
        str(dataset),
        "--server",
        "http://127.0.0.1:9",
        "--chat-url",
        "http://127.0.0.1:9/v1",
        *extra,
    ]


class TestOptions:
    def test_every_documented_option_is_parsed(
        self, dataset: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The issue's options map onto EvalOptions, keys read from the named variables."""
        monkeypatch.setenv("SRV_KEY", "s3cret")
        monkeypatch.setenv("LLM_KEY", "l1m")
        args = build_parser().parse_args(
            run_args(
                dataset,
                "--server-api-key-env",
                "SRV_KEY",
                "--llm-api-key-env",
                "LLM_KEY",
                "--concurrency",
                "3",
                "--n",
                "4",
                "--rows",
                "0-2",
                "--agent-timeout-sec",
                "30",
                "--grader-timeout-sec",
                "5",
                "--output",
                "outdir",
                "--name",
                "myrun",
                "--fresh",
                "--pass-threshold",
                "0.5",
                "--max-consecutive-infra-failures",
                "7",
            )
        )
        options = options_from_args(args)
        assert options.server_api_key == "s3cret"
        assert options.llm_api_key == "l1m"
        assert (options.concurrency, options.n, options.rows) == (3, 4, "0-2")
        assert (options.agent_timeout_sec, options.grader_timeout_sec) == (30.0, 5.0)
        assert options.output == Path("outdir")
        assert (options.run_name, options.mode, options.pass_threshold) == ("myrun", "fresh", 0.5)
        assert options.max_consecutive_infra_failures == 7
        assert options.deadline_sec() == 95.0
        assert "s3cret" not in repr(options)

    def test_keys_remember_their_variables(
        self, dataset: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Each key read from the environment names its variable (for a "rejected the key
        in $NAME" message) and shows no secret in its repr."""
        monkeypatch.setenv("SRV_KEY", "s3cret")
        monkeypatch.setenv("LLM_KEY", "l1m")
        args = build_parser().parse_args(
            run_args(dataset, "--server-api-key-env", "SRV_KEY", "--llm-api-key-env", "LLM_KEY")
        )
        options = options_from_args(args)
        assert describe_key(options.server_api_key or "", "server_api_key") == "the key in $SRV_KEY"
        assert describe_key(options.llm_api_key or "", "llm_api_key") == "the key in $LLM_KEY"
        assert "s3cret" not in repr(options.server_api_key)
        assert describe_key("plain", "server_api_key") == "the key given as server_api_key"

    def test_server_may_repeat(self, dataset: Path) -> None:
        """--server given several times names the first server and the extra ones."""
        args = build_parser().parse_args(run_args(dataset, "--server", "http://127.0.0.1:10"))
        options = options_from_args(args)
        assert options.server_url == "http://127.0.0.1:9"
        assert options.extra_server_urls == ("http://127.0.0.1:10",)
        assert options.server_urls == ("http://127.0.0.1:9", "http://127.0.0.1:10")

    def test_resume_and_fresh_are_exclusive(self, dataset: Path) -> None:
        """--resume and --fresh together are a usage error."""
        with pytest.raises(SystemExit) as caught:
            build_parser().parse_args(run_args(dataset, "--resume", "--fresh"))
        assert caught.value.code == 2


class TestCollector:
    def test_a_run_tunes_the_collector_and_restores_it(self) -> None:
        """Inside collector_tuned() what lived before is frozen and only the young
        generation's threshold is GC_YOUNG_THRESHOLD; afterwards both are as before."""
        gc.unfreeze()  # start with nothing frozen, as a fresh rollout-eval process does
        before = gc.get_threshold()
        with collector_tuned():
            assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, *before[1:])
            assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == before
        assert gc.get_freeze_count() == 0

    def test_objects_frozen_before_stay_frozen(self) -> None:
        """A process that froze objects itself keeps them frozen after the run."""
        gc.freeze()
        try:
            frozen = gc.get_freeze_count()
            with collector_tuned():
                pass
            assert gc.get_freeze_count() >= frozen > 0
        finally:
            gc.unfreeze()

    def test_the_collector_is_restored_when_the_run_fails(self) -> None:
        """An exception inside still restores the thresholds."""
        before = gc.get_threshold()
        with pytest.raises(RuntimeError, match="boom"), collector_tuned():
            raise RuntimeError("boom")
        assert gc.get_threshold() == before


class TestMain:
    def test_unset_key_variable_is_a_bad_input(
        self, dataset: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A key variable that is not set exits 2 and names the variable and the flag."""
        monkeypatch.delenv("NOPE_KEY", raising=False)
        status = main(run_args(dataset, "--server-api-key-env", "NOPE_KEY"))
        assert status == 2
        assert "NOPE_KEY (named by --server-api-key-env) is not set" in capsys.readouterr().err

    def test_negative_timeout_is_a_bad_input(
        self, dataset: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A non-positive timeout exits 2 naming the flag."""
        assert main(run_args(dataset, "--agent-timeout-sec", "-1")) == 2
        assert "--agent-timeout-sec must be > 0 seconds; got -1" in capsys.readouterr().err

    def test_unreachable_server_exits_1(
        self, dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A rollout server nobody listens on is reported with its URL; exit status 1."""
        status = main(run_args(dataset, "--output", str(tmp_path / "out")))
        assert status == 1
        assert "cannot reach the rollout server at http://127.0.0.1:9" in capsys.readouterr().err

    def test_show_prints_a_written_summary(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """show renders summary.json of a run directory; a missing one exits 2."""
        from rollout_client.eval import summarize

        run_dir = tmp_path / "run"
        run_dir.mkdir()
        summary = summarize([], items=[(0, 0)], n=1, pass_threshold=1.0, run={"name": "run"})
        (run_dir / "summary.json").write_text(json.dumps(summary))
        assert main(["show", str(run_dir)]) == 0
        assert "run 'run', 1 items (1 pending)" in capsys.readouterr().out
        assert main(["show", str(tmp_path / "nothing")]) == 2
        assert "holds the files of a run" in capsys.readouterr().err


class TestCommandLine:
    def test_version(self, capsys: pytest.CaptureFixture[str]) -> None:
        """--version prints the distribution's version and the protocol version, exit 0."""
        with pytest.raises(SystemExit) as caught:
            main(["--version"])
        assert caught.value.code == 0
        assert capsys.readouterr().out == (
            f"rollout-eval {rollout_client.__version__} (rollout protocol {PROTOCOL_VERSION})\n"
        )

    @pytest.mark.parametrize("command", ["run", "show", "report"])
    def test_bad_option_prints_the_subcommand_usage(
        self, dataset: Path, capsys: pytest.CaptureFixture[str], command: str
    ) -> None:
        """An unknown option of a subcommand exits 2 with that subcommand's usage."""
        argv = run_args(dataset, "--bogus") if command == "run" else [command, "d", "--bogus"]
        with pytest.raises(SystemExit) as caught:
            main(argv)
        assert caught.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"usage: rollout-eval {command} ")
        assert f"rollout-eval {command}: error: unrecognized arguments: --bogus" in err


SHORT_OUTAGE_EVAL: Final = (
    "import sys; from rollout_client import RetrySettings; "
    "import rollout_client.eval._client_seam as seam, rollout_client.eval._scheduler as sched; "
    "seam.OUTAGE_RETRY = RetrySettings(); sched.ADMISSION_OUTAGE_DELAYS_SEC = (0.1, 0.5); "
    "from rollout_client.eval._cli import main; sys.exit(main())"
)
"""``rollout-eval`` with the protocol's short transport schedule instead of the 16.6 s
outage schedule (as the in-process tests run; see conftest's ``short_outage_schedule``)."""


async def run_process(
    dataset: Path,
    script: RolloutScript,
    *extra: str,
    env: dict[str, str] | None = None,
    short_outage: bool = False,
) -> tuple[int, str]:
    """Run ``rollout-eval run`` in a subprocess against ``script``; its status and stderr.

    With ``short_outage`` the command gives up on a dead server after 0.6 s of retries.
    """
    command = ("-c", SHORT_OUTAGE_EVAL) if short_outage else ("-m", "rollout_client.eval")
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        *command,
        "run",
        str(dataset),
        "--server",
        script.url,
        "--chat-url",
        script.url + "/v1",
        "--output",
        str(dataset.parent / "out"),
        *extra,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    try:
        async with asyncio.timeout(PROCESS_SEC):
            _, err = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, err.decode()


def rows(path: Path, count: int) -> Path:
    return write_dataset(path, [{"user_prompt": "q", "label": str(i)} for i in range(count)])


class TestClosingLine:
    async def test_server_shutting_down(
        self, rollout_script: Callable[..., Awaitable[RolloutScript]], tmp_path: Path
    ) -> None:
        """A server answering 503 "shutting down" ends the run like Ctrl-C does: exit 1 and
        "<why>; N items pending. Re-run the same command to resume." last."""

        def admit(_label: str) -> web.StreamResponse | None:
            if script.admitted:
                return web.json_response({"detail": "rollout server is shutting down"}, status=503)
            return None

        script = await rollout_script(admit=admit, outcome=lambda _label: result_fields("pass"))
        code, err = await run_process(rows(tmp_path / "d.jsonl", 4), script, "--concurrency", "1")
        assert code == 1, err
        assert err.splitlines()[-1] == (
            "rollout-eval: the rollout server is shutting down (it answered 503 to a new "
            "rollout); 3 items pending. Re-run the same command to resume."
        )

    async def test_server_crash(
        self, rollout_script: Callable[..., Awaitable[RolloutScript]], tmp_path: Path
    ) -> None:
        """A server that dies with rollouts in flight ends the run with the stop rule's reason
        and the same closing line; the cancels that cannot reach it make one line."""
        both_admitted = asyncio.Event()

        def admit(_label: str) -> web.StreamResponse | None:
            if len(script.admitted) == 1:
                both_admitted.set()
            return None

        script = await rollout_script(admit=admit, outcome=lambda _label: None)
        dataset = rows(tmp_path / "d.jsonl", 6)
        process = asyncio.ensure_future(
            run_process(
                dataset,
                script,
                "--concurrency",
                "2",
                "--max-consecutive-infra-failures",
                "2",
                short_outage=True,
            )
        )
        async with asyncio.timeout(PROCESS_SEC):
            await both_admitted.wait()
        script.crash()
        code, err = await process
        assert code == 1, err
        last = err.splitlines()[-1]
        assert last.startswith(
            "rollout-eval: stopped after 2 consecutive infrastructure failures (last: "
            "transport_error: "
        ), err
        assert last.endswith("; 6 items pending. Re-run the same command to resume."), err
        assert err.count("could not cancel") <= 1


class TestTerminal:
    async def test_log_lines_clear_and_redraw_the_bar_which_fits_the_terminal(
        self, rollout_script: Callable[..., Awaitable[RolloutScript]], tmp_path: Path
    ) -> None:
        """The client's retry warning is written as its own prefixed line (the progress line
        cleared first and redrawn after), and no progress line is wider than the 60-column
        terminal ($COLUMNS)."""
        polls: dict[str, int] = {}

        def outcome(label: str) -> dict[str, Any] | None:
            polls[label] = polls.get(label, 0) + 1
            return result_fields("drop" if polls[label] == 1 else "pass")

        script = await rollout_script(outcome=outcome)
        code, err = await run_process(
            rows(tmp_path / "d.jsonl", 1),
            script,
            "--progress",
            "bar",
            env={"COLUMNS": "60"},
        )
        assert code == 0, err
        warning = re.search(
            r"\r\x1b\[2Krollout-eval: WARNING rollout_client: Retrying result read for rollout "
            r"\w+ after ServerDisconnectedError \(attempt 1\) in 0\.10s\n0/1  pass -  ",
            err,
        )
        assert warning is not None, err
        bars = [part for part in re.split(r"\r\x1b\[2K|\n", err) if "/1  pass " in part]
        assert bars
        assert max(len(bar) for bar in bars) <= 59

    async def test_the_pools_lines_go_around_the_bar_too(
        self, rollout_script: Callable[..., Awaitable[RolloutScript]], tmp_path: Path
    ) -> None:
        """With two --server, the pool's warning that a server left the rotation (it
        answered 503 "shutting down") is a prefixed line that clears and redraws the bar;
        the other server runs the item."""
        leaving = await rollout_script(
            admit=lambda _label: web.json_response(
                {"detail": "rollout server is shutting down"}, status=503
            )
        )
        staying = await rollout_script(outcome=lambda _label: result_fields("pass"))
        code, err = await run_process(
            rows(tmp_path / "d.jsonl", 1),
            leaving,
            "--server",
            staying.url,
            "--progress",
            "bar",
            env={"COLUMNS": "60"},
        )
        assert code == 0, err
        assert (leaving.posted, staying.posted) == (["0"], ["0"])
        line = (
            f"\r\x1b[2Krollout-eval: WARNING rollout_client: Rollout server {leaving.url} is "
            "out of rotation: POST /rollout answered 503 (shutting down)\n0/1  pass -  "
        )
        assert line in err, err


class TestLogRouting:
    async def test_a_record_during_the_report_is_a_rollout_eval_line(
        self,
        fakes: Any,
        dataset: Path,
        tmp_path: Path,
        capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """A warning logged while `rollout-eval report` writes the report (logging not
        configured) is written to stderr as a rollout-eval line, not Python's bare one."""
        from rollout_client.eval import EvalOptions, run_eval
        from rollout_client.eval import _cli as cli

        async def succeed(request: dict[str, Any], _cancelled: asyncio.Event) -> Any:
            return fakes.success(request["rollout_id"], 1.0)

        options = EvalOptions(
            dataset=dataset,
            server_url="http://127.0.0.1:9",
            chat_url="http://127.0.0.1:9/v1",
            output=tmp_path / "out",
            progress="off",
        )
        server = fakes.FakeServer(succeed)
        report = await run_eval(options, stream=io.StringIO(), client_factory=server.factory)
        write_report = cli.write_report

        def logging_write_report(run_dir: Path) -> Path:
            logging.getLogger("rollout_client.eval").warning("the report is large")
            return write_report(run_dir)

        monkeypatch.setattr(cli, "write_report", logging_write_report)
        monkeypatch.setattr(logging.getLogger(), "handlers", [])  # as in a fresh process
        assert main(["report", str(report.run_dir)]) == 0
        captured = capsys.readouterr()
        assert captured.err == "rollout-eval: WARNING rollout_client.eval: the report is large\n"
        assert captured.out == f"{report.run_dir / 'report.html'}\n"
        assert logging.getLogger().handlers == []
