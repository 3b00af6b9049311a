"""The progress display: bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import io

from rollout_client.eval._progress import Progress, format_duration


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
        progress = Progress(total=2, stream=stream, mode="bar", clock=clock)
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
