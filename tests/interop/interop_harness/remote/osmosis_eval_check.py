"""Read an ``osmosis eval run`` run directory with osmosis-ai's own readers.

Run by the osmosis-ai 0.3.8 venv's interpreter: ``python osmosis_eval_check.py RUN_DIR``.
Prints one JSON object:

* ``accepted``: for each row of ``index.jsonl``, ``{rollout_id: bool}``: whether the reader
  ``osmosis eval run`` polls with after each result accepts
  ``rollout_trials/<rollout_id>/trajectory.json`` (it parses, and its identity is the id);
* ``upload_files``: the files osmosis-ai's upload would send (building the plan validates
  every listed trajectory strictly against osmosis-ai's ATIF model and the row it belongs
  to), or ``upload_error``: why it refused the run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from osmosis_ai.eval.local.results import read_valid_trajectory
from osmosis_ai.eval.local.upload import LocalEvalUploadError, build_eval_upload_plan


def main() -> None:
    run_dir = Path(sys.argv[1])
    rows = [json.loads(line) for line in (run_dir / "index.jsonl").read_text().splitlines()]
    accepted = {}
    for row in rows:
        rollout_id = row["rollout_id"]
        path = run_dir / "rollout_trials" / rollout_id / "trajectory.json"
        accepted[rollout_id] = read_valid_trajectory(path, rollout_id=rollout_id) is not None
    report: dict[str, object] = {"accepted": accepted}
    try:
        plan = build_eval_upload_plan(run_dir)
    except LocalEvalUploadError as exc:
        report["upload_error"] = f"{exc} (caused by: {exc.__cause__!r})"
    else:
        report["upload_files"] = [file.path for file in plan.files]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
