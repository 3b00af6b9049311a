"""The chaos soak's check (``tools/soak.py``): every item of the run has exactly one final
outcome in ``events.jsonl``, none lost, none twice, nothing recorded after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "tools") not in sys.path:
    sys.path.insert(0, str(ROOT / "tools"))

from raycluster import LocalRayHead, processes_under  # noqa: E402
from soak import build_parser, check_journal, main  # noqa: E402

ITEMS = {(0, 0), (1, 0), (2, 0)}


def journal(path: Path, *records: tuple[int, str, str | None]) -> Path:
    lines: list[dict[str, Any]] = [
        {
            "row_index": row,
            "run_index": 0,
            "rollout_id": f"r{index}",
            "status": None,
            "reward": None,
            "err_category": category,
            "err_message": None,
            "outcome": outcome,
            "latency_sec": None,
        }
        for index, (row, outcome, category) in enumerate(records)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


def test_one_final_outcome_each_after_retries_holds(tmp_path: Path) -> None:
    path = journal(
        tmp_path / "events.jsonl",
        (0, "infra_failure", "internal_error"),
        (1, "success", None),
        (0, "success", None),
        (2, "failed", "agent_error"),
    )
    problems, counts = check_journal(path, ITEMS)
    assert problems == []
    assert counts["items retried"] == 1
    assert counts["final success"] == 2
    assert counts["final failed"] == 1
    assert counts["  internal_error"] == 1


def test_lost_duplicated_late_and_foreign_records_are_each_named(tmp_path: Path) -> None:
    path = journal(
        tmp_path / "events.jsonl",
        (0, "success", None),
        (0, "success", None),
        (1, "success", None),
        (1, "infra_failure", "transport_error"),
        (7, "success", None),
    )
    problems, _ = check_journal(path, ITEMS)
    assert problems == [
        "item (0, 0): 2 final outcomes (['success', 'success'])",
        "item (1, 0): a record after its final outcome (['success', 'infra_failure'])",
        "item (2, 0): 0 final outcomes ([])",
        "records for items outside the run: [(7, 0)]",
    ]


def test_the_by_hand_defaults_are_the_issues_soak() -> None:
    args = build_parser().parse_args([])
    assert (args.items, args.restart_every_sec, args.http_500_rate) == (500, 20.0, 0.05)


def test_ray_options_default_to_the_issues_worker_kill_period() -> None:
    args = build_parser().parse_args(["--ray"])
    assert (args.ray, args.worker_kill_every_sec, args.ray_workers) == (True, 15.0, 2)
    assert build_parser().parse_args([]).ray is False


def test_bad_ray_options_are_refused_with_their_name(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, name in (
        (["--ray", "--ray-workers", "0"], "--ray-workers must be at least 1"),
        (["--ray", "--worker-kill-every-sec", "0"], "--worker-kill-every-sec must be positive"),
    ):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
        assert name in capsys.readouterr().err


def test_cluster_processes_are_found_by_their_environment_and_ancestry(tmp_path: Path) -> None:
    """A process that names the cluster's directory only in its environment (as a retitled
    Ray worker does) is found; ``owns`` accepts the head's descendants only."""
    marker = tmp_path / "cluster"
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        env={**os.environ, "SOAK_TEST_DIR": str(marker)},
    )
    try:
        assert child.pid in processes_under(marker)
        assert os.getpid() not in processes_under(marker)
        head = LocalRayHead.__new__(LocalRayHead)
        head.process = SimpleNamespace(pid=os.getpid())  # type: ignore[assignment]
        assert head.owns(child.pid)
        head.process = SimpleNamespace(pid=child.pid)  # type: ignore[assignment]
        assert not head.owns(os.getpid())
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)
    assert child.pid not in processes_under(marker)
