"""What travels between :class:`~rollout_server.RayBackend`'s server and its workers.

Requests and outcomes travel as tuples of plain values: Ray packs those with msgpack, much
cheaper than pickling the attrs classes for every rollout. Each tuple is derived from its
class's attrs fields, in field order, so a field added to
:class:`~rollout_server.ExecutionRequest` or :class:`~rollout_server.Sample` travels
without a change here; what stays behind is named once:

* a request leaves the server's callbacks and its admission stamp behind
  (:data:`~rollout_server.execution._backend.SERVER_SET_FIELDS`): the worker gets the
  seconds since admission instead (monotonic clocks differ between nodes);
* a phase result leaves its diagnostics (``extra_fields``) and its sample's trajectory
  snapshot behind: both stay in the files on the worker's node.

Both sides are the same installation, so the layout needs no version of its own.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, Final, Generic, TypeVar

import attrs

from rollout_types import RolloutErrorCategory, RolloutStatus

from ..execution._backend import (
    REQUEST_FIELDS,
    ExecutionOutcome,
    ExecutionRequest,
    ExecutionResult,
    Sample,
)
from ..observability._observer import ExecutionObserver

__all__ = [
    "PhaseTimes",
    "decode_outcome",
    "decode_request",
    "encode_outcome",
    "encode_request",
    "payload_rollout_id",
]

T = TypeVar("T", bound=attrs.AttrsInstance)


class _Fields(Generic[T]):
    """The values of some of an attrs class's fields as a tuple, in field order, and back.

    Args:
        cls: The attrs class.
        names: The fields that travel (at least two), in field order.
    """

    __slots__ = ("_cls", "_get", "names")

    def __init__(self, cls: type[T], names: tuple[str, ...]) -> None:
        known = [field.name for field in attrs.fields(cls)]
        if len(names) < 2 or [name for name in known if name in names] != list(names):
            raise ValueError(f"{names!r} are not two or more fields of {cls.__name__} in order")
        self._cls = cls
        self.names = names
        self._get: Callable[[T], tuple[Any, ...]] = operator.attrgetter(*names)

    def encode(self, value: T) -> tuple[Any, ...]:
        """The fields' values."""
        return self._get(value)

    def decode(self, values: tuple[Any, ...], **others: Any) -> T:
        """An instance from :meth:`encode`'s ``values`` and the ``others`` fields."""
        return self._cls(**dict(zip(self.names, values, strict=True)), **others)


def _all_but(cls: type[Any], *left_out: str) -> tuple[str, ...]:
    return tuple(field.name for field in attrs.fields(cls) if field.name not in left_out)


_REQUEST: Final = _Fields(ExecutionRequest, REQUEST_FIELDS)
_SAMPLE: Final = _Fields(Sample, _all_but(Sample, "trajectory_messages"))


def encode_request(
    key: int, request: ExecutionRequest, elapsed_sec: float, process_id: str
) -> tuple[Any, ...]:
    """``request`` as :meth:`~rollout_server.ray._worker.RolloutWorker.run` receives it,
    under its dispatch ``key``: ``(key, request fields, elapsed_sec, process_id)``. One
    argument: Ray serializes each argument of a call on its own."""
    return (key, _REQUEST.encode(request), elapsed_sec, process_id)


_ID_AT: Final = REQUEST_FIELDS.index("id")


def payload_rollout_id(payload: tuple[Any, ...]) -> str:
    """The rollout id of an :func:`encode_request` payload (without decoding the rest)."""
    rollout_id: str = payload[1][_ID_AT]
    return rollout_id


def decode_request(
    payload: tuple[Any, ...],
    admitted_at: Callable[[float], float],
    on_status: Callable[[RolloutStatus], None],
    observer: ExecutionObserver,
) -> tuple[ExecutionRequest, str]:
    """The request of an :func:`encode_request` payload, with the worker's own admission
    stamp (``admitted_at(elapsed_sec)``), status sink and observer; and the server's
    ``process_id``."""
    _key, values, elapsed, process_id = payload
    request = _REQUEST.decode(
        values, admitted_at=admitted_at(elapsed), on_status=on_status, observer=observer
    )
    return request, process_id


def _encode_result(result: ExecutionResult | None) -> tuple[Any, ...] | None:
    if result is None:
        return None
    sample = result.sample
    packed = _SAMPLE.encode(sample) if isinstance(sample, Sample) else None
    category = None if result.err_category is None else str(result.err_category)
    return (str(result.status), packed, result.err_message, category)


def _decode_result(packed: tuple[Any, ...] | None) -> ExecutionResult | None:
    if packed is None:
        return None
    status, sample, message, category = packed
    return ExecutionResult(
        status=RolloutStatus(status),
        sample=None if sample is None else _SAMPLE.decode(sample),
        err_message=message,
        err_category=None if category is None else RolloutErrorCategory(category),
    )


@attrs.define(kw_only=True, eq=False)
class PhaseTimes(ExecutionObserver):
    """The phase times a worker's LocalBackend measured for one rollout (its observer
    there); they travel back with the outcome for the server's observer."""

    workflow_sec: float | None = None
    grading_sec: float | None = None
    write_sec: float | None = None
    write_failed: bool = False

    def observe_queue_wait(self, seconds: float) -> None:
        """Ignored: a worker never queues; the server measures the queue wait."""

    def observe_workflow(self, seconds: float) -> None:
        """Keep the workflow's time."""
        self.workflow_sec = seconds

    def observe_grading(self, seconds: float) -> None:
        """Keep the grader's time."""
        self.grading_sec = seconds

    def observe_trajectory_write(self, seconds: float, *, failed: bool) -> None:
        """Keep the trajectory write's time."""
        self.write_sec = seconds
        self.write_failed = failed

    def replay(self, observer: ExecutionObserver) -> None:
        """Report the kept times to ``observer`` (on the server's loop)."""
        if self.workflow_sec is not None:
            observer.observe_workflow(self.workflow_sec)
        if self.grading_sec is not None:
            observer.observe_grading(self.grading_sec)
        if self.write_sec is not None:
            observer.observe_trajectory_write(self.write_sec, failed=self.write_failed)


_TIMES: Final = _Fields(PhaseTimes, _all_but(PhaseTimes))


def encode_outcome(outcome: ExecutionOutcome, times: PhaseTimes) -> tuple[Any, ...]:
    """What :meth:`~rollout_server.ray._worker.RolloutWorker.run` returns for a finished
    rollout: ``(workflow result, grader result, phase times)``.

    Anything in a sample must pickle; otherwise the server reports the rollout as
    ``internal_error`` saying its result could not be returned.
    """
    return (_encode_result(outcome.workflow), _encode_result(outcome.grader), _TIMES.encode(times))


def decode_outcome(reply: tuple[Any, ...]) -> tuple[ExecutionOutcome, PhaseTimes]:
    """The outcome and phase times of an :func:`encode_outcome` reply."""
    workflow, grader, times = reply
    decoded = _decode_result(workflow)
    assert decoded is not None
    return (
        ExecutionOutcome(workflow=decoded, grader=_decode_result(grader)),
        _TIMES.decode(times),
    )
