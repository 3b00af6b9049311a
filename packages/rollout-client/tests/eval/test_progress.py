"""The progress display: bar on a terminal, plain lines otherwise, log lines around it."""

from __future__ import annotations

import io
import logging

import pytest

from rollout_client.eval._progress import (
    Progress,
    ProgressLogHandler,
    format_duration,
    routed_logging,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TestProgress:
    def test_plain_lines_are_periodic(self) -> None:
        """Plain mode prints one line per interval with counts, pass rate, rate and ETA."""
        clock, stream = FakeClock(), io.StringIO()
        progress = Progress(total=4, stream=stream, mode="plain", interval_sec=10, clock=clock)
        clock.now = 1.0
        progress.record("success", passed=True)
        clock.now = 2.0
        progress.record("failed")
        clock.now = 12.0
        progress.record("infra_failure")
        lines = stream.getvalue().splitlines()
        assert lines[0] == "rollout-eval: 1/4  pass 100.0%  failed 0  infra 0  1.0/s  ETA 3s"
        assert lines[1].startswith("rollout-eval: 2/4  pass 50.0%  failed 1  infra 1")
        assert len(lines) == 2

    def test_bar_redraws_in_place(self) -> None:
        """Bar mode redraws one line with a carriage return and ends it on close."""
        clock, stream = FakeClock(), io.StringIO()
        progress = Progress(total=2, stream=stream, mode="bar", clock=clock, columns=lambda: 80)
        clock.now = 1.0
        progress.record("success", passed=True)
        progress.message("note")
        progress.close()
        text = stream.getvalue()
        assert "\r\x1b[2K[##########..........] 1/2" in text
        assert "note\n" in text
        assert text.endswith("\n")

    def test_auto_mode_follows_the_terminal(self) -> None:
        """auto is bar on a terminal and plain otherwise."""
        assert Progress.resolve_mode("auto", io.StringIO()) == "plain"

        class Tty(io.StringIO):
            def isatty(self) -> bool:
                return True

        assert Progress.resolve_mode("auto", Tty()) == "bar"

    def test_resumed_counts_are_preloaded(self) -> None:
        """Items done before a resume count toward completed and pass rate."""
        progress = Progress(total=10, stream=io.StringIO(), mode="off")
        progress.preload(done=4, passed=2, scored=4, failed=1)
        assert progress.line().startswith("rollout-eval: 4/10  pass 50.0%  failed 1")

    def test_format_duration(self) -> None:
        """Durations read as seconds, minutes or hours."""
        assert format_duration(42) == "42s"
        assert format_duration(75) == "1m15s"
        assert format_duration(3725) == "1h02m"


def busy_progress(columns: int, clock: FakeClock) -> Progress:
    """A bar of 5,000 items, 1,234 done in 10 minutes (an ETA of half an hour)."""
    progress = Progress(
        total=5000, stream=io.StringIO(), mode="bar", clock=clock, columns=lambda: columns
    )
    clock.now = 600.0
    for index in range(1234):
        progress.record("success" if index % 4 else "failed", passed=index % 4 != 0)
    for _ in range(12):
        progress.record("infra_failure")
    return progress


class TestBarWidth:
    @pytest.mark.parametrize("columns", [30, 40, 60, 80, 88, 120, 200])
    def test_bar_never_exceeds_the_terminal(self, columns: int) -> None:
        """With four-digit counts and an ETA in minutes the line stays within the
        terminal's width minus one column, and the count is always shown."""
        line = busy_progress(columns, FakeClock()).line()
        assert len(line) <= columns - 1
        assert "1234/5000" in line

    def test_wide_terminal_shows_everything(self) -> None:
        """120 columns hold the 20-character bar and every field."""
        line = busy_progress(120, FakeClock()).line()
        assert line.startswith("[####................] 1234/5000  pass 75.0%  failed 309  ")
        assert line.endswith("infra 12  2.1/s  ETA 30m31s")

    def test_narrow_terminal_drops_the_bar_then_the_rate(self) -> None:
        """60 columns lose the bar and the rate, but keep counts, pass rate and ETA."""
        assert busy_progress(60, FakeClock()).line() == (
            "1234/5000  pass 75.0%  failed 309  infra 12  ETA 30m31s"
        )

    def test_layout_does_not_change_as_the_numbers_grow(self) -> None:
        """The bar's width is the same from the first item to the last."""
        clock = FakeClock()
        progress = Progress(
            total=100, stream=io.StringIO(), mode="bar", clock=clock, columns=lambda: 80
        )
        widths = set()
        for _ in range(100):
            clock.now += 1.0
            progress.record("success", passed=True)
            widths.add(progress.line().index("]"))
        assert widths == {13}  # a 12-character bar between its brackets


class TestLogLines:
    def test_a_record_clears_the_bar_and_redraws_it(self) -> None:
        """A warning logged while the bar is shown is written on its own line, prefixed
        with rollout-eval, level and logger, and the bar is redrawn below it."""
        clock, stream = FakeClock(), io.StringIO()
        progress = Progress(total=2, stream=stream, mode="bar", clock=clock, columns=lambda: 80)
        progress.draw(force=True)
        handler = ProgressLogHandler(io.StringIO())
        handler.progress = progress
        logger = logging.getLogger("rollout_client.test_progress")
        logger.addHandler(handler)
        logger.propagate = False
        try:
            logger.warning("retrying in %.2fs", 0.1)
        finally:
            logger.removeHandler(handler)
            logger.propagate = True
        bar = progress.line()
        assert stream.getvalue() == (
            f"\r\x1b[2K{bar}\r\x1b[2Krollout-eval: WARNING rollout_client.test_progress: "
            f"retrying in 0.10s\n{bar}"
        )

    def test_without_progress_lines_go_to_the_stream(self) -> None:
        """Before the progress display exists, records are plain prefixed lines."""
        stream = io.StringIO()
        handler = ProgressLogHandler(stream)
        handler.handle(logging.makeLogRecord({"name": "x", "levelname": "ERROR", "msg": "m"}))
        assert stream.getvalue() == "rollout-eval: ERROR x: m\n"

    def test_routing_only_when_logging_is_not_configured(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """With no root handler the handler is installed for the block and removed after;
        with one (the program configured logging) nothing is changed."""
        root = logging.getLogger()
        with routed_logging(io.StringIO()) as handler:
            assert handler is None  # pytest's own handlers are installed
        monkeypatch.setattr(root, "handlers", [])
        with routed_logging(io.StringIO()) as handler:
            assert root.handlers == [handler]
        assert root.handlers == []

    def test_an_inner_block_shares_the_outer_handler(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Inside a routing block (the CLI's) another one (run_eval's) yields the same handler;
        the progress the inner block gives it is undone when that block ends."""
        root = logging.getLogger()
        monkeypatch.setattr(root, "handlers", [])
        with routed_logging(io.StringIO()) as outer:
            assert outer is not None
            with routed_logging(io.StringIO()) as inner:
                assert inner is outer
                inner.progress = Progress(total=1, stream=io.StringIO(), mode="off")
            assert outer.progress is None
            assert root.handlers == [outer]
        assert root.handlers == []
