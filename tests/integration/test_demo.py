"""The one-command demo (tools/demo.py) runs end to end and shuts its servers down cleanly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class TestDemo:
    def test_demo_runs_the_dataset_and_stops_both_servers_cleanly(self, tmp_path: Path) -> None:
        """The demo prints the summary of all 50 questions and both servers exit 0 on SIGTERM."""
        completed = subprocess.run(
            [sys.executable, str(ROOT / "tools" / "demo.py"), "--output", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert completed.returncode == 0, completed.stdout + completed.stderr
        out = completed.stdout
        assert "rollout-eval summary: run 'demo', 50 items (complete)" in out
        assert "both servers stopped with SIGTERM and exited with status 0" in out
        summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
        assert summary["items"] == {"total": 50, "done": 50, "pending": 0, "scored": 50}
        # The stand-in's 10% wrong-answer rate makes rewards vary, but most answers are right.
        assert 0.5 < summary["pass"]["rate"] < 1.0
        trajectories = list((tmp_path / "demo-trajectories").glob("*/trajectory.json"))
        assert len(trajectories) == 50

    def test_repeated_demo_starts_afresh_without_streaming(self, tmp_path: Path) -> None:
        """A second demo run over the same output starts afresh rather than resuming."""
        for _ in range(2):
            completed = subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "tools" / "demo.py"),
                    "--output",
                    str(tmp_path),
                    "--no-stream",
                    "--latency-ms",
                    "0",
                ],
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            assert completed.returncode == 0, completed.stdout + completed.stderr
            assert "50 items (complete)" in completed.stdout
            assert "resuming" not in completed.stderr
