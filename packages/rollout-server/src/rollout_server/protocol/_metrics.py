"""``ServerMetrics``: the Prometheus metrics of one rollout server (``GET /metrics``).

Each server has its own :class:`prometheus_client.CollectorRegistry` (never the global
one), so several servers in one process keep separate figures. Two kinds of figures:

* counters and histograms updated where things happen (an admission answered, a phase
  ended, a result published or collected, a cancel answered): one lock and an add each,
  with every label combination resolved once, here;
* gauges read when scraped (:class:`_StateCollector`): statuses, waiting polls and
  uncollected results from the registry, capacity from ``backend.health()``, lifecycle
  from the server. Nothing is counted up and down on the rollout path for them.

The table of names and labels is in the package README ("Metrics"). Label values are
bounded sets (status codes, statuses, error categories, dispositions); no rollout id or
other unbounded value is ever a label.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any, Final, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from rollout_types import (
    PROTOCOL_VERSION,
    CancelDisposition,
    RolloutErrorCategory,
    RolloutStatus,
)

from .._version import VERSION
from ..execution._backend import ExecutionBackend
from ..observability._observer import ExecutionObserver
from ..state._record import RolloutRecord
from ..state._registry import RolloutRegistry

__all__ = [
    "ADMISSION_CODES",
    "FILE_BUCKETS_SEC",
    "HTTP_REFUSAL_REASONS",
    "LATENCY_BUCKETS_SEC",
    "NO_CATEGORY",
    "MetricsSource",
    "ServerMetrics",
]


LATENCY_BUCKETS_SEC: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0,
)  # fmt: skip
"""Upper bounds (seconds) of the rollout-time histograms: from a trivial rollout (ms) to an
hour-long agent run."""

FILE_BUCKETS_SEC: Final = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Upper bounds (seconds) of the trajectory-write histogram: tens of microseconds on a
local disk, up to the 10 s bound of a file job."""

ADMISSION_CODES: Final = (202, 400, 408, 409, 413, 422, 429, 500, 503)
"""The answers ``POST /rollout`` gives after the middleware (each counted from 0)."""

HTTP_REFUSAL_REASONS: Final = ("bad_request", "header_timeout")
"""Why a request was refused before any route (:mod:`rollout_server.http._connection`): it
could not be parsed (a JSON 400), or its headers did not arrive in time (closed)."""

NO_CATEGORY: Final = "none"
"""The ``category`` label of a rollout finished without an error category."""

_IN_PROGRESS: Final = (RolloutStatus.QUEUED, RolloutStatus.RUNNING, RolloutStatus.GRADING)


class MetricsSource(Protocol):
    """What the scrape-time gauges read of a server (:class:`~rollout_server.RolloutServer`)."""

    @property
    def registry(self) -> RolloutRegistry:
        """The rollouts."""
        ...

    @property
    def backend(self) -> ExecutionBackend:
        """The backend, whose ``health()`` has its capacity."""
        ...

    @property
    def accepting_rollouts(self) -> bool:
        """Whether admissions are open."""
        ...

    @property
    def draining(self) -> bool:
        """Whether the staged shutdown is running."""
        ...


def _count(value: Any) -> float | None:
    """A capacity figure of ``backend.health()`` as a number, or None (absent, unbounded)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


# Speed: benchmarks/README.md, "Server: observability", row "Gauges (statuses, waiting polls,
#   uncollected results, capacity, lifecycle) computed when scraped ..."
class _StateCollector(Collector):
    """The gauges of one server, computed at scrape time."""

    def __init__(self, source: MetricsSource) -> None:
        self._source = source
        self._info = {"version": VERSION, "protocol_version": PROTOCOL_VERSION}

    def describe(self) -> list[Metric]:
        """No fixed description: the backend gauges appear only when it reports them."""
        return []

    def collect(self) -> Iterator[Metric]:
        source = self._source
        registry = source.registry
        by_status = dict.fromkeys(_IN_PROGRESS, 0)
        waiting = 0
        for record in registry.in_flight():
            if record.body is None:
                status = record.status
                if status in by_status:
                    by_status[status] += 1
                waiting += record.waiting
        in_progress = GaugeMetricFamily(
            "rollout_in_progress",
            "Rollouts admitted and not yet published, by their status now.",
            labels=["status"],
        )
        for status, count in by_status.items():
            in_progress.add_metric([status.value], count)
        yield in_progress
        yield GaugeMetricFamily(
            "rollout_long_polls_waiting",
            "Result long polls waiting for a rollout's status to change.",
            value=waiting,
        )
        yield GaugeMetricFamily(
            "rollout_results_uncollected",
            "Results published and not yet returned by any poll (still retained).",
            value=registry.undelivered,
        )
        yield GaugeMetricFamily(
            "rollout_records",
            "Rollout records held: in progress, and published results within retention.",
            value=len(registry),
        )
        yield GaugeMetricFamily(
            "rollout_executions_active",
            "Execution tasks not yet completed (health's lifecycle.active_rollouts).",
            value=registry.active,
        )
        yield GaugeMetricFamily(
            "rollout_accepting",
            "1 while admissions are open, 0 once shutdown has begun.",
            value=int(source.accepting_rollouts),
        )
        yield GaugeMetricFamily(
            "rollout_draining",
            "1 while the staged shutdown runs.",
            value=int(source.draining),
        )
        yield from self._backend_gauges(source.backend)
        info = InfoMetricFamily("rollout_server", "The rollout server's version.")
        info.add_metric([], self._info)
        yield info

    @staticmethod
    def _backend_gauges(backend: ExecutionBackend) -> Iterator[Metric]:
        """Capacity from ``backend.health()["concurrency"]`` (LocalBackend's shape)."""
        try:
            health: Any = backend.health()
        except Exception:  # noqa: BLE001 - /health logs it; a scrape goes on without it
            return
        concurrency = health.get("concurrency") if isinstance(health, Mapping) else None
        if not isinstance(concurrency, Mapping):
            return
        for key, name, text in (
            ("max_concurrent", "rollout_backend_slots", "Execution slots (absent: no limit)."),
            ("running", "rollout_backend_running", "Rollouts holding a slot."),
            ("queued", "rollout_backend_queued", "Rollouts waiting for a slot."),
            (
                "max_queued",
                "rollout_backend_max_queued",
                "Most rollouts that may wait before admission answers 429 (absent: no bound).",
            ),
        ):
            value = _count(concurrency.get(key))
            if value is not None:
                yield GaugeMetricFamily(name, text, value=value)


# Speed: benchmarks/README.md, "Server: observability", row "Gauges (statuses, waiting polls,
#   uncollected results, capacity, lifecycle) computed when scraped ..."
class ServerMetrics(ExecutionObserver):
    """The metrics of one server (see the module docstring and the README's table).

    It is the server's registry observer (publication, collection), cancellation hook and
    the :class:`~rollout_server.observability._observer.ExecutionObserver` of every execution
    request.

    Args:
        source: The server whose state the gauges read at scrape time.

    Attributes:
        registry: The Prometheus registry holding every metric of this server.
    """

    __slots__ = (
        "_admissions",
        "_admissions_total",
        "_cancellations",
        "_collection",
        "_finished",
        "_finished_total",
        "_grading",
        "_http_refusals",
        "_lease_expiries",
        "_publication",
        "_queue_wait",
        "_trajectory_failures",
        "_trajectory_write",
        "_workflow",
        "registry",
    )

    def __init__(self, source: MetricsSource) -> None:
        registry = self.registry = CollectorRegistry(auto_describe=True)
        admissions = self._admissions_total = Counter(
            "rollout_admissions",
            "Answers to POST /rollout, by status code (202 admitted; 409 duplicate; "
            "422/400/413 bad request; 408 body too slow; 429 backend full; 503 shutting "
            "down; 500 internal error).",
            ["code"],
            registry=registry,
        )
        self._admissions = {code: admissions.labels(str(code)) for code in ADMISSION_CODES}
        self._finished_total = Counter(
            "rollout_finished",
            "Rollouts whose result was published, by status and error category.",
            ["status", "category"],
            registry=registry,
        )
        self._finished: dict[tuple[str, str], Any] = {}
        for status in (RolloutStatus.SUCCESS, RolloutStatus.CANCELLED, RolloutStatus.FAILURE):
            self._finished_child(status.value, NO_CATEGORY)
        for category in RolloutErrorCategory:
            self._finished_child(RolloutStatus.FAILURE.value, category.value)
        refusals = Counter(
            "rollout_http_refusals",
            "Requests refused before any route: bad_request (unparsable, a 400) or "
            "header_timeout (headers not complete within the header read timeout).",
            ["reason"],
            registry=registry,
        )
        self._http_refusals = {reason: refusals.labels(reason) for reason in HTTP_REFUSAL_REASONS}
        self._lease_expiries = Counter(
            "rollout_lease_expiries",
            "Rollouts published as failure / lease_expired (no poll within the lease).",
            registry=registry,
        )
        cancellations = Counter(
            "rollout_cancellations",
            "Dispositions answered by POST /rollout/cancel (and the shutdown's cancel).",
            ["disposition"],
            registry=registry,
        )
        self._cancellations = {
            disposition.value: cancellations.labels(disposition.value)
            for disposition in CancelDisposition
        }
        self._queue_wait = Histogram(
            "rollout_queue_wait_seconds",
            "Admission until an execution slot was taken (or the wait ended otherwise).",
            registry=registry,
            buckets=LATENCY_BUCKETS_SEC,
        )
        self._workflow = Histogram(
            "rollout_workflow_seconds",
            "Workflow run time, whatever its end.",
            registry=registry,
            buckets=LATENCY_BUCKETS_SEC,
        )
        self._grading = Histogram(
            "rollout_grading_seconds",
            "Grader run time, whatever its end.",
            registry=registry,
            buckets=LATENCY_BUCKETS_SEC,
        )
        self._publication = Histogram(
            "rollout_admission_to_publication_seconds",
            "Admission until the result was published.",
            registry=registry,
            buckets=LATENCY_BUCKETS_SEC,
        )
        self._collection = Histogram(
            "rollout_admission_to_collection_seconds",
            "Admission until a poll first returned the published result.",
            registry=registry,
            buckets=LATENCY_BUCKETS_SEC,
        )
        self._trajectory_write = Histogram(
            "rollout_trajectory_write_seconds",
            "Saving a rollout's trajectory.json (and diagnostics.json), submission to end.",
            registry=registry,
            buckets=FILE_BUCKETS_SEC,
        )
        self._trajectory_failures = Counter(
            "rollout_trajectory_write_failures",
            "Trajectory writes that failed or did not finish within their bound.",
            registry=registry,
        )
        registry.register(_StateCollector(source))
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)

    def _finished_child(self, status: str, category: str) -> Any:
        child = self._finished.get((status, category))
        if child is None:
            child = self._finished[(status, category)] = self._finished_total.labels(
                status, category
            )
        return child

    # -- exposition -----------------------------------------------------------------------

    def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """The metrics as ``(body, content type)``: the Prometheus text format, or
        OpenMetrics when ``accept`` (the request's ``Accept`` header) asks for it."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type

    # -- hooks ----------------------------------------------------------------------------

    def admission_answered(self, code: int) -> None:
        """``POST /rollout`` answered with ``code``."""
        child = self._admissions.get(code)
        if child is None:  # an answer the table does not list: counted all the same
            child = self._admissions[code] = self._admissions_total.labels(str(code))
        child.inc()

    def http_refused(self, reason: str) -> None:
        """A request was refused before any route, for ``reason`` (one of
        :data:`HTTP_REFUSAL_REASONS`)."""
        self._http_refusals[reason].inc()

    def published(
        self,
        record: RolloutRecord,
        status: RolloutStatus,
        category: RolloutErrorCategory | None,
    ) -> None:
        """A result was published (a registry observer)."""
        label = NO_CATEGORY if category is None else category.value
        self._finished_child(status.value, label).inc()
        if category is RolloutErrorCategory.LEASE_EXPIRED:
            self._lease_expiries.inc()
        self._publication.observe(time.monotonic() - record.admitted_at)

    def delivered(self, record: RolloutRecord) -> None:
        """A poll first returned a published result (a registry observer)."""
        self._collection.observe(time.monotonic() - record.admitted_at)

    def cancelled(self, dispositions: Mapping[str, CancelDisposition]) -> None:
        """A cancel request was answered with ``dispositions`` (the cancellation hook)."""
        counters = self._cancellations
        for disposition in dispositions.values():
            counters[disposition].inc()

    def observe_queue_wait(self, seconds: float) -> None:
        """See :class:`~rollout_server.observability._observer.ExecutionObserver`."""
        self._queue_wait.observe(seconds)

    def observe_workflow(self, seconds: float) -> None:
        """See :class:`~rollout_server.observability._observer.ExecutionObserver`."""
        self._workflow.observe(seconds)

    def observe_grading(self, seconds: float) -> None:
        """See :class:`~rollout_server.observability._observer.ExecutionObserver`."""
        self._grading.observe(seconds)

    def observe_trajectory_write(self, seconds: float, *, failed: bool) -> None:
        """See :class:`~rollout_server.observability._observer.ExecutionObserver`."""
        self._trajectory_write.observe(seconds)
        if failed:
            self._trajectory_failures.inc()
