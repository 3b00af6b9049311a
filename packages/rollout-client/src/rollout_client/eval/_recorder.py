"""The recording half of a run: every ending of a work item becomes a journal line, a sample
line, a progress count and a step of the stop rule.

The stop rule: after ``max_consecutive_infra_failures`` infrastructure failures in a row
(default 5; 0 never stops; any final outcome resets the count; the rollouts one server
restart failed count once, see :mod:`._outage`) the recorder asks
:class:`RunControl` to stop, and the scheduler then starts no new rollouts and cancels the
in-flight ones, which stay pending. An error no rollout can survive (another protocol
version, the key refused) stops the run at once. A server that is shutting down (``503`` on
admission; with several servers, none admits and one of them is shutting down) makes the
recorder ask for a drain instead: no new rollouts, the in-flight ones are collected and
recorded.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import attrs

from rollout_types import RolloutResultResponse

from ._control import RunControl
from ._journal import Journal, JournalRecord
from ._outage import restart_key
from ._outcomes import (
    Classified,
    classify_exception,
    classify_result,
    deadline_exceeded,
    passes,
    run_stopping_reason,
    server_draining_reason,
)
from ._progress import Progress

__all__ = ["Recorder", "preload_progress"]

Item = tuple[int, int]


def preload_progress(
    progress: Progress, done: Iterable[JournalRecord], *, pass_threshold: float
) -> None:
    """Count the items a resumed run finished before (their latest ``done`` records)."""
    records = list(done)
    progress.preload(
        done=len(records),
        passed=sum(1 for rec in records if passes(rec.outcome, rec.reward, pass_threshold)),
        scored=sum(1 for rec in records if rec.outcome in ("success", "failed")),
        failed=sum(1 for rec in records if rec.outcome == "failed"),
    )


@attrs.define(kw_only=True, eq=False)
class Recorder:
    """Records the endings of one invocation's work items (see the module docstring).

    Args:
        journal: The open journal of the run.
        progress: The counts and messages shown to the user.
        control: Asked to stop by the stop rule.
        samples_path: ``samples.jsonl`` of the run.
        pass_threshold: Reward at or above which a success passes.
        max_consecutive_infra_failures: The stop rule's limit (0: never stop).
    """

    journal: Journal
    progress: Progress
    control: RunControl
    samples_path: Path
    pass_threshold: float
    max_consecutive_infra_failures: int
    consecutive_infra: int = attrs.field(default=0, init=False)
    """Infrastructure failures in a row so far (the stop rule's count)."""
    recorded_items: set[Item] = attrs.field(factory=set, init=False)
    """The items this run appended a journal record for."""
    restarts: set[str] = attrs.field(factory=set, init=False)
    """The ``process_id`` of each server process whose end failed rollouts of this run
    (each counts once towards the stop rule)."""

    def record(
        self,
        item: Item,
        rollout_id: str,
        classified: Classified,
        *,
        status: str | None,
        latency_sec: float | None,
        result: RolloutResultResponse | None = None,
    ) -> None:
        """Append one outcome to the journal (and its sample), count it, apply the stop rule.

        Raises:
            JournalError, OSError: The journal cannot be written (the run must stop).
        """
        outcome, err_category, err_message = (
            classified.outcome,
            classified.err_category,
            classified.err_message,
        )
        assert outcome is not None, "a cancelled rollout is never recorded"
        row_index, run_index = item
        record = JournalRecord(
            row_index=row_index,
            run_index=run_index,
            rollout_id=rollout_id,
            status=status,
            reward=classified.reward,
            err_category=err_category,
            err_message=err_message,
            outcome=outcome,
            latency_sec=latency_sec,
        )
        self.journal.append(record)
        self.recorded_items.add(item)
        if result is not None and result.sample is not None:
            self._write_sample(record, result)
        passed = passes(outcome, classified.reward, self.pass_threshold)
        self.progress.record(outcome, passed=passed)
        if outcome == "infra_failure":
            restart = restart_key(err_category, err_message)
            if restart is not None and restart in self.restarts:
                return  # this restart counted (and was reported) once already
            self.consecutive_infra += 1
            if restart is not None:
                self.restarts.add(restart)
            if self.control.stop.is_set():
                return  # stopping already: the summary counts the rest
            if restart is not None:
                self.progress.message(
                    f"rollout-eval: the rollout server restarted (process {restart} ended): "
                    "the rollouts it had in flight failed and stay pending (re-run the same "
                    "command to run them again); they count as one infrastructure failure"
                )
            else:
                self.progress.message(
                    f"rollout-eval: row {row_index} run {run_index}: infrastructure failure "
                    f"({err_category}): {err_message}"
                )
            limit = self.max_consecutive_infra_failures
            if limit and self.consecutive_infra >= limit:
                self.control.request_stop(
                    f"stopped after {self.consecutive_infra} consecutive infrastructure failures "
                    f"(last: {err_category}: {err_message})"
                )
        else:
            self.consecutive_infra = 0

    def record_result(
        self,
        item: Item,
        rollout_id: str,
        result: RolloutResultResponse,
        *,
        latency_sec: float,
        cancel_requested: bool,
    ) -> None:
        """Record a terminal result; a ``cancelled`` one is not recorded (the item stays
        pending) and counts as an infrastructure failure unless this run asked for it."""
        classified = classify_result(result)
        if classified.outcome is None:
            if not cancel_requested:
                # Cancelled by someone else (an operator, a server shutting down).
                self.consecutive_infra += 1
                if not self.control.stop.is_set():  # stopping: the closing line counts it
                    self.progress.message(
                        f"rollout-eval: row {item[0]} run {item[1]} was cancelled by the "
                        "server; it stays pending"
                    )
            return
        self.record(
            item,
            rollout_id,
            classified,
            status=str(result.status),
            latency_sec=latency_sec,
            result=result,
        )

    def record_exception(
        self, item: Item, rollout_id: str, exc: Exception, *, latency_sec: float, phase: str
    ) -> None:
        """Record what admitting (``phase="admission"``) or awaiting (``"result"``) raised,
        stop the run when no rollout can succeed, or drain it when the server is shutting
        down (the item is not recorded, it stays pending)."""
        reason = run_stopping_reason(exc, phase=phase)
        if reason is not None:
            self.control.request_stop(reason)
            return
        reason = server_draining_reason(exc, phase=phase)
        if reason is not None:
            self.control.request_drain(reason)
            return
        classified = classify_exception(exc, phase=phase)
        self.record(item, rollout_id, classified, status=None, latency_sec=latency_sec)

    def record_overrun(
        self, item: Item, rollout_id: str, *, deadline_sec: float, latency_sec: float
    ) -> None:
        """Record a rollout that had no result ``deadline_sec`` after admission."""
        classified = deadline_exceeded(deadline_sec)
        self.record(item, rollout_id, classified, status=None, latency_sec=latency_sec)

    def _write_sample(self, record: JournalRecord, result: RolloutResultResponse) -> None:
        sample = result.sample
        assert sample is not None
        line = {
            "row_index": record.row_index,
            "run_index": record.run_index,
            "rollout_id": record.rollout_id,
            "outcome": record.outcome,
            "reward": sample.reward,
            "remove_sample": sample.remove_sample,
            "messages": sample.messages,
            "metrics": sample.metrics,
        }
        try:
            text = json.dumps(line, ensure_ascii=False, allow_nan=False, default=str)
        except ValueError:
            return
        with self.samples_path.open("a", encoding="utf-8") as file:
            file.write(text + "\n")
