"""The rollout-eval command line: options, errors and exit statuses."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest

from rollout_client.eval._cli import (
    GC_YOUNG_THRESHOLD,
    build_parser,
    collector_tuned,
    main,
    options_from_args,
)


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
