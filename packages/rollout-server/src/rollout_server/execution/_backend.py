"""The execution backend interface: what the server calls to run a rollout.

A backend executes admitted rollouts and reports an :class:`ExecutionOutcome`; the server
owns everything else (leases, long polls, publication, retention). Methods other than
:meth:`ExecutionBackend.execute` have working defaults, so a minimal backend implements
one coroutine.

Admission control, for a backend with a bound on the work it takes: the server asks
:meth:`~ExecutionBackend.try_reserve` once per admission (False: 429). A True answer holds
room for that rollout until the server calls :meth:`~ExecutionBackend.release_reservation`,
which it does in the same event-loop turn as the rollout's ``execute()`` takes its first
step, right before that step (or when the rollout is cancelled before it starts). The
backend's :attr:`~ExecutionBackend.admission_mode` says how it counts:

* ``"reservations"``: it counts its reservations plus the work it has started, so it sees
  every admitted rollout at every moment; the server asks for every admission at once,
  however many arrive together (LocalBackend, RayBackend);
* ``"started_work"`` (the default): it answers from the work it has started only (the
  default :meth:`~ExecutionBackend.try_reserve` asks :meth:`~ExecutionBackend.has_capacity`,
  as an osmosis-ai backend answers); the server then admits one rollout at a time while
  earlier admissions have not started yet (each waits for the one before it to take its
  first step, usually within one loop turn), which is exact too.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, ClassVar, Final, Literal

import attrs

from rollout_types import RolloutErrorCategory, RolloutInitRequest, RolloutStatus

from ..observability._observer import NO_OBSERVER, ExecutionObserver

__all__ = [
    "INIT_NAMES",
    "REQUEST_FIELDS",
    "SERVER_ONLY_INIT_FIELDS",
    "SERVER_SET_FIELDS",
    "AdmissionMode",
    "ExecutionBackend",
    "ExecutionOutcome",
    "ExecutionRequest",
    "ExecutionResult",
    "Sample",
    "admission_mode_of",
    "request_from_init",
]

AdmissionMode = Literal["reservations", "started_work"]
"""How a backend counts admitted rollouts (:attr:`ExecutionBackend.admission_mode`)."""


def _ignore_status(_status: RolloutStatus) -> None:
    return None


@attrs.define(kw_only=True, eq=False)
class Sample:
    """A rollout's sample as user code builds it (mutable: graders set the reward in place).

    ``trajectory_messages`` is a snapshot kept for trajectory persistence only; it never
    goes on the wire. ``metrics`` and ``extra_fields`` may hold anything: the server makes
    them JSON-safe before sending.
    """

    messages: list[dict[str, Any]] = attrs.Factory(list)
    label: str | None = None
    reward: float | None = None
    remove_sample: bool = False
    metrics: dict[str, Any] = attrs.Factory(dict)
    extra_fields: dict[str, Any] = attrs.Factory(dict)
    trajectory_messages: list[dict[str, Any]] | None = None


@attrs.frozen(kw_only=True)
class ExecutionRequest:
    """One admitted rollout, as the server hands it to :meth:`ExecutionBackend.execute`.

    Timeouts are float seconds measured from ``admitted_at`` (a ``time.monotonic()``
    value); ``None`` means unbounded, zero or less means already expired.
    ``request_extra_fields`` is for persistence only: it is not input to the workflow.
    With a model gateway (``--gateway``), ``chat_completions_url`` is the rollout's route
    through it, not the caller's URL.
    ``on_status`` reports a non-terminal status change (``queued``, ``running``,
    ``grading``) to the server's registry; it is safe to call from the event loop only.
    ``observer`` takes the phase timings the backend measures (the server's metrics; a
    no-op unless the server sets it), also from the event loop only.
    ``weight_version`` and ``group_id`` are the request's (protocol 1.1; None when not
    given): the policy weights' version the caller serves the rollout with, and the group
    (GRPO) it belongs to.

    .. versionchanged:: 0.3
       ``weight_version`` and ``group_id``.
    """

    id: str
    prompt: list[dict[str, Any]]
    chat_completions_url: str
    llm_api_key: str | None = attrs.field(default=None, repr=False)
    label: str | None = None
    metadata: dict[str, Any] | None = None
    grade: bool = True
    agent_timeout_sec: float | None = None
    grader_timeout_sec: float | None = None
    request_extra_fields: dict[str, Any] | None = None
    admitted_at: float = 0.0
    on_status: Callable[[RolloutStatus], None] = attrs.field(
        default=_ignore_status, repr=False, eq=False
    )
    observer: ExecutionObserver = attrs.field(default=NO_OBSERVER, repr=False, eq=False)
    weight_version: str | None = None
    group_id: str | None = None


SERVER_SET_FIELDS: Final = frozenset({"admitted_at", "on_status", "observer"})
""":class:`ExecutionRequest` fields the server sets itself, of its own clock and loop."""

REQUEST_FIELDS: Final = tuple(
    field.name for field in attrs.fields(ExecutionRequest) if field.name not in SERVER_SET_FIELDS
)
"""The :class:`ExecutionRequest` fields that come from the admission request, in field
order: the server copies them from ``POST /rollout`` (:func:`request_from_init`), and
RayBackend sends them to its workers (:mod:`rollout_server.ray._codec`)."""

INIT_NAMES: Final = {
    "id": "rollout_id",
    "prompt": "initial_messages",
    "request_extra_fields": "extra_fields",
}
"""Each request field's name in ``RolloutInitRequest`` where the two differ."""

SERVER_ONLY_INIT_FIELDS: Final = frozenset({"return_turns"})
"""``RolloutInitRequest`` fields the server acts on itself and the backend never sees:
``return_turns`` (whether the result carries the captured model turns)."""


def _init_copier() -> Callable[..., ExecutionRequest]:
    """The body of :func:`request_from_init`, generated once from :data:`REQUEST_FIELDS` (as
    attrs generates ``__init__``): as cheap as the keyword call written out, where building
    a dict of the fields per admission took 2-3 us more."""
    copies = ", ".join(f"{name}=init.{INIT_NAMES.get(name, name)}" for name in REQUEST_FIELDS)
    source = (
        "def copy(init, admitted_at, on_status, observer):\n"
        f"    return ExecutionRequest({copies}, admitted_at=admitted_at, "
        "on_status=on_status, observer=observer)\n"
    )
    namespace: dict[str, Any] = {"ExecutionRequest": ExecutionRequest}
    exec(source, namespace)  # noqa: S102 - the source is made of attrs field names only
    copy: Callable[..., ExecutionRequest] = namespace["copy"]
    return copy


_copy_init: Final = _init_copier()


def request_from_init(
    init: RolloutInitRequest,
    *,
    admitted_at: float,
    on_status: Callable[[RolloutStatus], None],
    observer: ExecutionObserver,
) -> ExecutionRequest:
    """The :class:`ExecutionRequest` of an admitted ``init`` (each of
    :data:`REQUEST_FIELDS` from its ``RolloutInitRequest`` counterpart), with the
    server's admission stamp, status sink and observer."""
    return _copy_init(init, admitted_at, on_status, observer)


@attrs.frozen(kw_only=True)
class ExecutionResult:
    """What one phase (workflow or grader) produced.

    ``extra_fields`` holds backend diagnostics; it is persisted, never sent.
    """

    status: RolloutStatus
    sample: Sample | None = None
    err_message: str | None = None
    err_category: RolloutErrorCategory | None = None
    extra_fields: dict[str, Any] | None = None


@attrs.frozen(kw_only=True)
class ExecutionOutcome:
    """The result of :meth:`ExecutionBackend.execute`: the workflow's, and the grader's if
    grading ran (or was due and impossible)."""

    workflow: ExecutionResult
    grader: ExecutionResult | None = None

    def reported(self) -> ExecutionResult:
        """The result the server reports (wire-protocol section 4.7, step 4).

        A failed workflow reports itself (borrowing the grader's sample if it has none); a
        successful one reports the grader result when grading produced one.
        """
        workflow, grader = self.workflow, self.grader
        if workflow.status != RolloutStatus.SUCCESS:
            if workflow.sample is None and grader is not None and grader.sample is not None:
                return attrs.evolve(workflow, sample=grader.sample)
            return workflow
        return grader if grader is not None else workflow


class ExecutionBackend(abc.ABC):
    """The interface the rollout server calls. Subclass it and implement :meth:`execute`.

    All methods run on the server's event loop.
    """

    reports_queue_status: ClassVar[bool] = False
    """True when the backend itself reports ``queued``/``running`` through
    ``request.on_status``; otherwise the server reports ``running`` as soon as the
    execution task starts (as osmosis-ai does)."""

    admission_mode: ClassVar[AdmissionMode] = "started_work"
    """How :meth:`try_reserve` counts admitted rollouts (see the module docstring):
    ``"reservations"`` when it counts each reservation until :meth:`release_reservation`
    (the server then asks for concurrent admissions at once), ``"started_work"`` (the
    default) when it answers from the work started only (the server then lets one
    admission ask at a time while an earlier one has not started). A backend that never
    refuses may say ``"reservations"``: it has nothing to count.

    .. versionadded:: 0.3
    """

    @abc.abstractmethod
    async def execute(self, request: ExecutionRequest) -> ExecutionOutcome:
        """Run one rollout to its outcome.

        It may raise: the server reports the exception as ``failure`` with a category.
        It must honour task cancellation (``asyncio.CancelledError``).
        """

    def has_capacity(self) -> bool:
        """Whether a new rollout may be admitted now; False makes admission answer 429.

        Asked by the default :meth:`try_reserve`, once per admission. Default: always True.
        """
        return True

    def try_reserve(self) -> bool:
        """Hold room for one rollout being admitted; False refuses it (429 + Retry-After).

        The server calls this once per admission and pairs every True answer with
        exactly one :meth:`release_reservation` call: right before the rollout's
        ``execute()`` takes its first step, in the same loop turn, or when the rollout
        never starts (cancelled first, or refused as a duplicate id). Count the
        reservations held together with the work started, set :attr:`admission_mode` to
        ``"reservations"``, and the bound holds at any number of concurrent admissions.

        Default: ``self.has_capacity()``, holding nothing (with the default
        ``admission_mode``, ``"started_work"``, the server admits one rollout at a time
        while an earlier admission has not started; see the module docstring).

        .. versionadded:: 0.2
        """
        return self.has_capacity()

    def release_reservation(self) -> None:  # noqa: B027 - optional hook with a no-op default
        """End a reservation taken by :meth:`try_reserve` (see there); default: nothing.

        .. versionadded:: 0.2
        """

    def retry_after_sec(self) -> float:
        """Seconds a refused caller should wait (the 429 ``Retry-After``); default 5.

        The server clamps the value to [1, 60] and rounds it up to whole seconds.
        """
        return 5.0

    def rollout_status(self, rollout_id: str) -> dict[str, Any] | None:
        """Live or retained state of a rollout, such as ``{"status": "running"}``.

        Used only to interpret a backend ``not_found`` during cancellation. Default: None.
        """
        return None

    async def cancel_rollouts(
        self, *, ids: list[str] | None = None, prefix: str | None = None, all: bool = False
    ) -> dict[str, str]:
        """Cancel rollouts in the backend; return a disposition per id it handled.

        Default ``{}``: "unsupported", so the server cancels its own execution task. A
        backend that answers ``not_found`` for finished work must keep that work's
        terminal status visible through :meth:`rollout_status` until delivery.
        """
        return {}

    def health(self) -> dict[str, Any]:
        """Backend fields merged into ``GET /health``; default ``{"status": "ok"}``."""
        return {"status": "ok"}

    async def startup(self) -> None:  # noqa: B027 - optional hook with a no-op default
        """Acquire resources (a cluster, workers) before the first admission.

        The app awaits it at startup, before it serves; an exception stops the startup.
        Default: nothing.

        .. versionadded:: 0.2
        """

    async def shutdown(self) -> None:  # noqa: B027 - optional hook with a no-op default
        """Release resources once admissions have stopped and work has drained."""


def admission_mode_of(backend: ExecutionBackend) -> AdmissionMode:
    """``backend``'s :attr:`~ExecutionBackend.admission_mode`, checked.

    Raises:
        ValueError: When it is not one of :data:`AdmissionMode`'s values.
    """
    mode: object = getattr(backend, "admission_mode", None)
    if mode == "reservations":
        return "reservations"
    if mode == "started_work":
        return "started_work"
    raise ValueError(
        f"{type(backend).__qualname__}.admission_mode must be 'reservations' or "
        f"'started_work'; got {mode!r}"
    )
