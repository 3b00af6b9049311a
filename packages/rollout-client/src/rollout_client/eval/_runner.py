"""The evaluation runner: every (row, repetition) of a dataset through a rollout server.

:func:`run_eval` does what ``rollout-eval run`` does:

1. Validate the dataset and the options (before any network access or file change).
2. Open (or create, or with ``fresh`` archive and re-create) ``OUTPUT/NAME/``: refuse to
   resume when the inputs changed (see :mod:`.manifest`).
3. Ask the server's ``/health`` for its capacity (the default concurrency).
4. Run the pending work items, at most ``concurrency`` in flight, each with a fresh
   ``uuid4().hex`` rollout id, appending every terminal outcome to the journal.
5. Write ``summary.json`` and return it.

Outcome of one work item (the journal's ``outcome``):

=========================================================  ===============================
what happened                                              outcome
=========================================================  ===============================
``success`` (``remove_sample`` false)                      ``success``, with the reward
``success`` with ``remove_sample``                         ``skipped`` (not scored)
``failure`` with ``agent_error``, ``timeout``,             ``failed`` (scored as reward 0)
``validation_error`` or no category
``failure`` with ``lease_expired``, ``internal_error``,    ``infra_failure`` (never scored;
``http_error`` or a category this client does not know     pending again on resume)
transport error, protocol error, admission timeout,        ``infra_failure`` with category
item deadline overrun                                      ``transport_error``,
                                                           ``protocol_error``,
                                                           ``admission_timeout``,
                                                           ``deadline_exceeded``
``cancelled``                                              not recorded: the item stays
                                                           pending
=========================================================  ===============================

After ``max_consecutive_infra_failures`` infrastructure failures in a row the run stops
early: no new rollouts start, the in-flight ones are cancelled on the server and stay
pending, and the report says why. An interruption (:attr:`RunControl.stop`, set by the
first Ctrl-C of the CLI) does the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import json
import math
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final, Protocol, TextIO

import aiohttp

from rollout_types import RolloutErrorCategory, RolloutResultResponse, RolloutStatus

from .. import __version__
from .._client import RolloutClient
from .._errors import (
    RolloutAdmissionTimeoutError,
    RolloutProtocolError,
    RolloutProtocolVersionError,
)
from .._pool import RolloutClientPool
from ._dataset import Dataset, load_dataset, parse_row_selection
from ._errors import (
    EXIT_INCOMPLETE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EvalError,
    EvalInputError,
    RunStateError,
)
from ._journal import DONE_OUTCOMES, Journal, JournalRecord, latest_by_item
from ._manifest import (
    Manifest,
    RunInputs,
    compare_manifests,
    format_rows,
    read_manifest,
    write_manifest,
)
from ._progress import Progress
from ._summary import format_summary, summarize, write_summary

__all__ = [
    "DEFAULT_CONCURRENCY_WITHOUT_LIMIT",
    "DEFAULT_MAX_CONSECUTIVE_INFRA_FAILURES",
    "DEFAULT_OUTPUT_DIR",
    "EvalOptions",
    "EvalReport",
    "RunControl",
    "ServerUnavailableError",
    "capacity_from_health",
    "classify_result",
    "fetch_chat_models",
    "run_eval",
]

DEFAULT_OUTPUT_DIR: Final = Path(".rollout-eval")
"""Where runs go without ``--output``."""

DEFAULT_MAX_CONSECUTIVE_INFRA_FAILURES: Final = 5
"""Infrastructure failures in a row that stop a run early (0 disables the stop)."""

DEFAULT_CONCURRENCY_WITHOUT_LIMIT: Final = 32
"""Concurrency when the server reports no limit and ``--concurrency`` is not given."""

DEFAULT_ITEM_DEADLINE_SEC: Final = 3600.0
"""Bound on one rollout when the agent and grader timeouts are not both given."""

ITEM_DEADLINE_SLACK_SEC: Final = 60.0
"""Added to ``agent + grader`` timeouts to bound one rollout from admission to result."""

SETTLE_TIMEOUT_SEC: Final = 30.0
"""How long a stop waits for cancelled in-flight rollouts to report ``cancelled``."""

HEALTH_TIMEOUT_SEC: Final = 10.0
"""Bound on the initial ``/health`` check."""

CHAT_MODELS_TIMEOUT_SEC: Final = 5.0
"""Bound on ``GET {chat_url}/models``."""

_SCORED_FAILURE_CATEGORIES: Final = frozenset(
    {
        None,
        RolloutErrorCategory.AGENT_ERROR,
        RolloutErrorCategory.TIMEOUT,
        RolloutErrorCategory.VALIDATION_ERROR,
    }
)


class ServerUnavailableError(EvalError):
    """The rollout server cannot be used (unreachable, refuses the key, wrong protocol)."""


class _Handle(Protocol):
    rollout_id: str

    def __await__(self) -> Any: ...

    def cancel(self) -> bool: ...

    def done(self) -> bool: ...


class _Client(Protocol):
    async def health(self) -> dict[str, Any]: ...

    async def run_rollout_async(
        self,
        *,
        initial_messages: list[dict[str, Any]],
        chat_completions_url: str,
        rollout_id: str,
        llm_api_key: str | None = None,
        label: str | None = None,
        metadata: dict[str, Any] | None = None,
        grade: bool = True,
        agent_timeout_sec: float | None = None,
        grader_timeout_sec: float | None = None,
        extra_fields: dict[str, Any] | None = None,
    ) -> Any: ...

    async def cancel_rollout(self, rollout_id: str) -> Any: ...

    async def aclose(self) -> None: ...


ClientFactory = Callable[..., _Client]
"""Builds a client: called with ``url`` (or, for several servers, ``urls``), ``api_key`` and
``admission_timeout_sec``."""


def _default_client_factory(**kwargs: Any) -> _Client:
    client: _Client = RolloutClientPool(**kwargs) if "urls" in kwargs else RolloutClient(**kwargs)
    return client


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EvalOptions:
    """Everything one evaluation run needs.

    Attributes:
        dataset: The JSONL or CSV dataset.
        server_url: Base URL of the rollout server.
        extra_server_urls: Base URLs of further rollout servers; with any, rollouts are
            spread over all of them by :class:`~rollout_client.RolloutClientPool`
            (default none).
        chat_url: OpenAI-compatible base URL of the model (sent as ``chat_completions_url``).
        server_api_key: Bearer key of the rollout server, or None.
        llm_api_key: Key of the chat endpoint (sent as ``llm_api_key``), or None.
        concurrency: Most rollouts in flight; None: the server's reported capacity.
        n: Repetitions of each row (default 1).
        rows: ``--rows`` selection (``"3,7,10-20"``, 0-based), or None for every row.
        agent_timeout_sec: Per-rollout workflow budget sent to the server, or None.
        grader_timeout_sec: Per-rollout grader budget sent to the server, or None.
        output: Directory holding the runs (default ``.rollout-eval``).
        name: Run name (default: the dataset file's stem).
        mode: ``auto`` (resume when the run exists, else start), ``resume`` (the run must
            exist) or ``fresh`` (archive an existing run and start over).
        pass_threshold: Reward at or above which a success passes (default 1.0).
        max_consecutive_infra_failures: Infrastructure failures in a row that stop the
            run (default 5; 0 never stops).
        item_deadline_sec: Bound on one rollout from admission to result; default
            ``agent + grader + 60`` s when both timeouts are given, else 3600 s.
        admission_timeout_sec: Bound on one admission including 429 retries; default
            ``item_deadline_sec * concurrency`` (a full queue ahead of it).
        progress: ``auto``, ``bar``, ``plain`` or ``off``.
        progress_interval_sec: Seconds between plain progress lines (default 10.0).
    """

    dataset: Path
    server_url: str
    chat_url: str
    extra_server_urls: tuple[str, ...] = ()
    server_api_key: str | None = dataclasses.field(default=None, repr=False)
    llm_api_key: str | None = dataclasses.field(default=None, repr=False)
    concurrency: int | None = None
    n: int = 1
    rows: str | None = None
    agent_timeout_sec: float | None = None
    grader_timeout_sec: float | None = None
    output: Path = DEFAULT_OUTPUT_DIR
    name: str | None = None
    mode: str = "auto"
    pass_threshold: float = 1.0
    max_consecutive_infra_failures: int = DEFAULT_MAX_CONSECUTIVE_INFRA_FAILURES
    item_deadline_sec: float | None = None
    admission_timeout_sec: float | None = None
    progress: str = "auto"
    progress_interval_sec: float = 10.0

    def validate(self) -> None:
        """Check every option; raise :class:`EvalInputError` naming the bad one."""
        if self.mode not in ("auto", "resume", "fresh"):
            raise EvalInputError(f"mode must be 'auto', 'resume' or 'fresh', not {self.mode!r}")
        if self.concurrency is not None and self.concurrency < 1:
            raise EvalInputError(f"--concurrency must be at least 1, got {self.concurrency}")
        if self.n < 1:
            raise EvalInputError(f"--n must be at least 1, got {self.n}")
        if self.max_consecutive_infra_failures < 0:
            raise EvalInputError(
                "--max-consecutive-infra-failures must be 0 (never stop) or more, got "
                f"{self.max_consecutive_infra_failures}"
            )
        for flag, value in (
            ("--agent-timeout-sec", self.agent_timeout_sec),
            ("--grader-timeout-sec", self.grader_timeout_sec),
            ("--item-deadline-sec", self.item_deadline_sec),
            ("--admission-timeout-sec", self.admission_timeout_sec),
        ):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise EvalInputError(f"{flag} must be a finite number of seconds > 0, got {value}")
        if not math.isfinite(self.pass_threshold):
            raise EvalInputError(f"--pass-threshold must be finite, got {self.pass_threshold}")
        for flag, url in (
            *(("--server", server) for server in self.server_urls),
            ("--chat-url", self.chat_url),
        ):
            if not url.startswith(("http://", "https://")):
                raise EvalInputError(f"{flag} must be an http:// or https:// URL, got {url!r}")
        stripped = [url.rstrip("/") for url in self.server_urls]
        if len(set(stripped)) != len(stripped):
            raise EvalInputError(f"--server lists a URL twice: {list(self.server_urls)}")
        if self.name is not None and (
            not self.name.strip() or "/" in self.name or self.name in (".", "..")
        ):
            raise EvalInputError(
                f"--name must be a plain directory name (no '/'), got {self.name!r}"
            )

    @property
    def server_urls(self) -> tuple[str, ...]:
        """Every rollout server: ``server_url`` then ``extra_server_urls``."""
        return (self.server_url, *self.extra_server_urls)

    @property
    def run_name(self) -> str:
        """The run's name: ``name``, else the dataset's file stem."""
        return self.name or self.dataset.stem or "run"

    def deadline_sec(self) -> float:
        """The bound on one rollout (see :attr:`item_deadline_sec`)."""
        if self.item_deadline_sec is not None:
            return self.item_deadline_sec
        if self.agent_timeout_sec is not None and self.grader_timeout_sec is not None:
            return self.agent_timeout_sec + self.grader_timeout_sec + ITEM_DEADLINE_SLACK_SEC
        return DEFAULT_ITEM_DEADLINE_SEC


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EvalReport:
    """What a run produced.

    Attributes:
        run_dir: ``OUTPUT/NAME``.
        summary: The summary document (also in ``summary.json``).
        exit_code: 0 when every item is done, 1 when items stay pending (stopped early),
            130 when interrupted.
        stop_reason: Why the run stopped before finishing, or None.
        summary_text: The printed table.
    """

    run_dir: Path
    summary: dict[str, Any]
    exit_code: int
    stop_reason: str | None
    summary_text: str


class RunControl:
    """Lets the caller stop a run: :meth:`request_stop` is what the first Ctrl-C does."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.reason: str | None = None
        self.interrupted = False

    def request_stop(self, reason: str, *, interrupted: bool = False) -> None:
        """Stop starting rollouts, cancel the in-flight ones; the first reason is kept."""
        if not self.stop.is_set():
            self.reason = reason
            self.interrupted = interrupted
            self.stop.set()


def capacity_from_health(health: Mapping[str, Any]) -> int | None:
    """The concurrency capacity a ``/health`` body reports, or None when it reports none.

    Reads ``max_queue_depth`` (HarborBackend-style) or ``concurrency.max_concurrent``
    (LocalBackend), as ``osmosis eval run`` does.
    """
    for value in (
        health.get("max_queue_depth"),
        (health.get("concurrency") or {}).get("max_concurrent")
        if isinstance(health.get("concurrency"), dict)
        else None,
    ):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Classified:
    """How one terminal result is recorded: ``outcome`` (None: not recorded) and reward."""

    outcome: str | None
    reward: float | None
    err_category: str | None
    err_message: str | None


def classify_result(result: RolloutResultResponse) -> Classified:
    """Map a terminal result to its journal outcome (the table in the module docstring)."""
    category = None if result.err_category is None else str(result.err_category)
    if result.status == RolloutStatus.CANCELLED:
        return Classified(outcome=None, reward=None, err_category=category, err_message=None)
    if result.status == RolloutStatus.SUCCESS:
        sample = result.sample
        if sample is not None and sample.remove_sample:
            return Classified(outcome="skipped", reward=None, err_category=None, err_message=None)
        if sample is None or sample.reward is None:
            return Classified(
                outcome="failed",
                reward=None,
                err_category="no_reward",
                err_message="the server reported success without a reward (is grading on?)",
            )
        return Classified(
            outcome="success", reward=float(sample.reward), err_category=None, err_message=None
        )
    if result.status == RolloutStatus.FAILURE:
        scored = result.err_category in _SCORED_FAILURE_CATEGORIES
        return Classified(
            outcome="failed" if scored else "infra_failure",
            reward=None,
            err_category=category,
            err_message=result.err_message,
        )
    return Classified(
        outcome="infra_failure",
        reward=None,
        err_category="protocol_error",
        err_message=f"the rollout ended with the unknown status {str(result.status)!r}",
    )


async def fetch_chat_models(chat_url: str, api_key: str | None) -> tuple[str, ...] | None:
    """The sorted model ids ``GET {chat_url}/models`` lists, or None when it cannot be read."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=CHAT_MODELS_TIMEOUT_SEC)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(
                chat_url.rstrip("/") + "/models", headers=headers, allow_redirects=False
            ) as response,
        ):
            if response.status != 200:
                return None
            data = await response.json(content_type=None)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return None
    try:
        return tuple(sorted(str(entry["id"]) for entry in data["data"]))
    except (KeyError, TypeError):
        return None


def _archive(run_dir: Path) -> Path:
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    target = run_dir.with_name(f"{run_dir.name}.archived-{stamp}")
    suffix = 1
    while target.exists():
        suffix += 1
        target = run_dir.with_name(f"{run_dir.name}.archived-{stamp}-{suffix}")
    with Journal(run_dir / "events.jsonl"):  # refuses while another process runs it
        pass
    run_dir.rename(target)
    return target


@dataclasses.dataclass(eq=False)
class _Flight:
    item: tuple[int, int]
    rollout_id: str
    handle: _Handle | None = None
    admission: asyncio.Future[Any] | None = None
    cancel_sent: bool = False


class _Run:
    """The state of one invocation (see :func:`run_eval`)."""

    def __init__(
        self,
        *,
        options: EvalOptions,
        dataset: Dataset,
        journal: Journal,
        progress: Progress,
        client: _Client,
        cancel_client_factory: Callable[[], _Client],
        control: RunControl,
        samples_path: Path,
    ) -> None:
        self.options = options
        self.rows = {row.index: row for row in dataset.rows}
        self.journal = journal
        self.progress = progress
        self.client = client
        self.cancel_client_factory = cancel_client_factory
        self.control = control
        self.samples_path = samples_path
        self.flights: dict[str, _Flight] = {}
        self.consecutive_infra = 0
        self.deadline_sec = options.deadline_sec()
        self._cancel_client: _Client | None = None
        self._cancel_tasks: set[asyncio.Task[None]] = set()

    # -- recording ------------------------------------------------------------------

    def record(
        self,
        flight: _Flight,
        *,
        outcome: str,
        status: str | None,
        reward: float | None,
        err_category: str | None,
        err_message: str | None,
        latency_sec: float | None,
        result: RolloutResultResponse | None = None,
    ) -> None:
        row_index, run_index = flight.item
        record = JournalRecord(
            row_index=row_index,
            run_index=run_index,
            rollout_id=flight.rollout_id,
            status=status,
            reward=reward,
            err_category=err_category,
            err_message=err_message,
            outcome=outcome,
            latency_sec=latency_sec,
        )
        self.journal.append(record)
        if result is not None and result.sample is not None:
            self._write_sample(record, result)
        passed = outcome == "success" and (reward or 0.0) >= self.options.pass_threshold
        self.progress.record(outcome, passed=passed)
        if outcome == "infra_failure":
            self.consecutive_infra += 1
            if self.control.stop.is_set():
                return  # stopping already: the summary counts the rest
            self.progress.message(
                f"rollout-eval: row {row_index} run {run_index}: infrastructure failure "
                f"({err_category}): {err_message}"
            )
            limit = self.options.max_consecutive_infra_failures
            if limit and self.consecutive_infra >= limit:
                self.control.request_stop(
                    f"stopped after {self.consecutive_infra} consecutive infrastructure failures "
                    f"(last: {err_category}: {err_message}); fix the cause and re-run the same "
                    "command to resume the pending items"
                )
        else:
            self.consecutive_infra = 0

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

    # -- one item -------------------------------------------------------------------

    async def run_item(self, item: tuple[int, int]) -> None:
        row = self.rows[item[0]]
        flight = _Flight(item=item, rollout_id=uuid.uuid4().hex)
        self.flights[flight.rollout_id] = flight
        started = time.monotonic()
        try:
            admission = asyncio.ensure_future(
                self.client.run_rollout_async(
                    initial_messages=row.initial_messages,
                    chat_completions_url=self.options.chat_url,
                    rollout_id=flight.rollout_id,
                    llm_api_key=self.options.llm_api_key,
                    label=row.label,
                    metadata=row.metadata,
                    grade=True,
                    agent_timeout_sec=self.options.agent_timeout_sec,
                    grader_timeout_sec=self.options.grader_timeout_sec,
                    extra_fields={"row_index": item[0], "run_index": item[1]},
                )
            )
            flight.admission = admission
            try:
                handle = await admission
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if admission.cancelled() and (task is None or task.cancelling() == 0):
                    return  # abandoned by a stop (see cancel_in_flight): the item stays pending
                raise
            except Exception as exc:  # noqa: BLE001 - every failure is classified below
                self._record_exception(flight, exc, started, phase="admission")
                return
            flight.handle = handle
            admitted = time.monotonic()
            if self.control.stop.is_set():
                self.send_cancel(flight)
            deadline = asyncio.timeout(self.deadline_sec)
            try:
                async with deadline:
                    result: RolloutResultResponse = await handle
            except Exception as exc:  # noqa: BLE001 - every failure is classified below
                if deadline.expired():
                    await self._overrun(flight, handle, admitted)
                    return
                self._record_exception(flight, exc, admitted, phase="result")
                return
            self._record_result(flight, result, admitted)
        finally:
            self.flights.pop(flight.rollout_id, None)

    def _record_result(
        self, flight: _Flight, result: RolloutResultResponse, admitted: float
    ) -> None:
        latency = time.monotonic() - admitted
        classified = classify_result(result)
        if classified.outcome is None:
            if not flight.cancel_sent:
                # Cancelled by someone else (an operator, a server shutting down).
                self.consecutive_infra += 1
                self.progress.message(
                    f"rollout-eval: row {flight.item[0]} run {flight.item[1]} was cancelled by the "
                    "server; it stays pending"
                )
            return
        self.record(
            flight,
            outcome=classified.outcome,
            status=str(result.status),
            reward=classified.reward,
            err_category=classified.err_category,
            err_message=classified.err_message,
            latency_sec=latency,
            result=result,
        )

    def _record_exception(
        self, flight: _Flight, exc: Exception, since: float, *, phase: str
    ) -> None:
        latency = time.monotonic() - since
        if isinstance(exc, RolloutProtocolVersionError):
            self.control.request_stop(f"the rollout server speaks another protocol version: {exc}")
            return
        if isinstance(exc, RolloutProtocolError) and exc.status_code == 401:
            self.control.request_stop(
                f"the rollout server refused the API key (401) during {phase}; pass the right key "
                "with --server-api-key-env"
            )
            return
        if isinstance(exc, RolloutAdmissionTimeoutError):
            category = "admission_timeout"
        elif isinstance(exc, RolloutProtocolError):
            category = "protocol_error"
        elif isinstance(exc, aiohttp.ClientError | OSError | TimeoutError):
            category = "transport_error"
        else:
            category = "client_error"
        message = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        self.record(
            flight,
            outcome="infra_failure",
            status=None,
            reward=None,
            err_category=category,
            err_message=f"{phase}: {message}",
            latency_sec=latency,
        )

    async def _overrun(self, flight: _Flight, handle: _Handle, admitted: float) -> None:
        self.send_cancel(flight)
        with contextlib.suppress(Exception, asyncio.TimeoutError):
            async with asyncio.timeout(SETTLE_TIMEOUT_SEC):
                await handle
        if not handle.done():
            handle.cancel()
        self.record(
            flight,
            outcome="infra_failure",
            status=None,
            reward=None,
            err_category="deadline_exceeded",
            err_message=(
                f"no result within {self.deadline_sec:g} s of admission; the rollout was "
                "cancelled on the server (raise --item-deadline-sec if it needs longer)"
            ),
            latency_sec=time.monotonic() - admitted,
        )

    # -- cancellation ---------------------------------------------------------------

    def send_cancel(self, flight: _Flight) -> None:
        """Ask the server to cancel one admitted rollout (in the background, bounded)."""
        if flight.cancel_sent:
            return
        flight.cancel_sent = True
        task = asyncio.get_running_loop().create_task(self._cancel(flight.rollout_id))
        self._cancel_tasks.add(task)
        task.add_done_callback(self._cancel_tasks.discard)

    async def _cancel(self, rollout_id: str) -> None:
        if self._cancel_client is None:
            # A separate session: the polling session may be busy with long polls.
            self._cancel_client = self.cancel_client_factory()
        try:
            await self._cancel_client.cancel_rollout(rollout_id)
        except Exception as exc:  # noqa: BLE001 - best effort: the lease expires otherwise
            self.progress.message(
                f"rollout-eval: could not cancel rollout {rollout_id} on the server "
                f"({type(exc).__name__}: {exc}); its polling lease will expire instead"
            )

    def cancel_in_flight(self) -> None:
        """Cancel every in-flight rollout: admitted ones on the server, admissions locally.

        An admission abandoned mid-request may still have been admitted; the server then
        fails that rollout as ``lease_expired`` (and cancels its work) when nobody polls it.
        """
        for flight in list(self.flights.values()):
            if flight.handle is not None:
                self.send_cancel(flight)
            elif flight.admission is not None:
                flight.admission.cancel()

    async def close(self) -> None:
        """Finish pending cancel requests (bounded) and close the cancel client.

        When this task is being cancelled (a second Ctrl-C), the requests are abandoned.
        """
        task = asyncio.current_task()
        hurry = task is not None and task.cancelling() > 0
        if self._cancel_tasks and not hurry:
            await asyncio.wait(set(self._cancel_tasks), timeout=SETTLE_TIMEOUT_SEC)
        for cancel_task in set(self._cancel_tasks):
            cancel_task.cancel()
        if self._cancel_client is not None:
            await self._cancel_client.aclose()

    # -- the pool -------------------------------------------------------------------

    async def run_items(self, items: list[tuple[int, int]], concurrency: int) -> None:
        queue = deque(items)

        async def worker() -> None:
            while queue and not self.control.stop.is_set():
                await self.run_item(queue.popleft())

        workers = [asyncio.create_task(worker()) for _ in range(min(concurrency, len(items)))]
        stop_waiter = asyncio.create_task(self.control.stop.wait())
        try:
            pending: set[asyncio.Task[Any]] = set(workers)
            while pending:
                done, pending = await asyncio.wait(
                    pending | {stop_waiter}, return_when=asyncio.FIRST_COMPLETED
                )
                pending.discard(stop_waiter)
                failed = [t for t in done if t is not stop_waiter and t.exception() is not None]
                if failed:
                    # A bug or an unwritable journal: stop the others cleanly, then raise.
                    exc = failed[0].exception()
                    self.control.request_stop(f"stopping after an error: {exc!r}")
                if stop_waiter in done or failed:
                    break
            if self.control.stop.is_set():
                if self.control.reason:
                    self.progress.message(f"rollout-eval: {self.control.reason}")
                if self.flights:
                    self.progress.message(
                        f"rollout-eval: cancelling {len(self.flights)} in-flight rollouts on the "
                        "server; they stay pending (re-run the same command to resume)"
                    )
                self.cancel_in_flight()
                _, still = await asyncio.wait(workers, timeout=SETTLE_TIMEOUT_SEC)
                for task in still:
                    task.cancel()
            outcomes = await asyncio.gather(*workers, return_exceptions=True)
            for outcome in outcomes:
                if isinstance(outcome, Exception):
                    raise outcome
        finally:
            stop_waiter.cancel()
            for task in workers:
                task.cancel()
            await asyncio.gather(stop_waiter, *workers, return_exceptions=True)
            for flight in list(self.flights.values()):
                if flight.handle is not None and not flight.handle.done():
                    flight.handle.cancel()


def _prepare_run_dir(
    options: EvalOptions, manifest: Manifest, progress_stream: TextIO
) -> tuple[Path, list[str]]:
    run_dir = options.output / options.run_name
    manifest_path = run_dir / "manifest.json"
    warnings: list[str] = []
    exists = manifest_path.exists() or (run_dir / "events.jsonl").exists()
    if options.mode == "resume" and not exists:
        raise RunStateError(
            f"--resume: there is no run {options.run_name!r} in {options.output} to resume; "
            "drop --resume to start it"
        )
    if exists and options.mode == "fresh":
        archived = _archive(run_dir)
        progress_stream.write(f"rollout-eval: archived the previous run to {archived}\n")
        exists = False
    if exists:
        if not manifest_path.exists():
            raise RunStateError(
                f"{run_dir} has a journal but no manifest.json; re-run with --fresh to archive "
                "it and start over"
            )
        warnings = compare_manifests(read_manifest(manifest_path), manifest, run_dir=run_dir)
    else:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise EvalInputError(f"cannot create the run directory {run_dir}: {exc}") from None
        write_manifest(manifest_path, manifest)
    return run_dir, warnings


async def _check_server(client: _Client, url: str) -> dict[str, Any]:
    try:
        async with asyncio.timeout(HEALTH_TIMEOUT_SEC):
            return await client.health()
    except RolloutProtocolVersionError as exc:
        raise ServerUnavailableError(str(exc)) from None
    except RolloutProtocolError as exc:
        if exc.status_code == 401:
            raise ServerUnavailableError(
                f"the rollout server at {url} requires an API key (401); pass "
                "--server-api-key-env NAME with the key in environment variable NAME"
            ) from None
        raise ServerUnavailableError(
            f"the rollout server at {url} answered GET /health badly: {exc}"
        ) from None
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise ServerUnavailableError(
            f"cannot reach the rollout server at {url} ({type(exc).__name__}: "
            f"{exc}); start it (rollout-server serve MODULE:ATTR) or fix --server"
        ) from None


async def run_eval(
    options: EvalOptions,
    *,
    stream: TextIO,
    control: RunControl | None = None,
    client_factory: ClientFactory | None = None,
) -> EvalReport:
    """Run (or resume) one evaluation; see the module docstring.

    Args:
        options: The run's options.
        stream: Where progress and messages go (normally stderr); the summary table is
            returned in the report, not written here.
        control: Lets the caller stop the run (the CLI's Ctrl-C); default: a private one.
        client_factory: Builds the rollout client; called with ``url`` (or ``urls`` when
            there are extra servers), ``api_key`` and ``admission_timeout_sec``; default
            :class:`RolloutClient` (:class:`RolloutClientPool` for ``urls``).

    Returns:
        The report: run directory, summary, exit code and stop reason.

    Raises:
        EvalInputError: For invalid options, a bad dataset (file, line, field), a run
            whose inputs changed, or an unusable run directory.
        JournalError: When the journal is corrupt or another process holds the run.
        ServerUnavailableError: When the rollout server cannot be used.
    """
    options.validate()
    control = control or RunControl()
    factory = client_factory or _default_client_factory
    dataset = load_dataset(options.dataset)
    selected = (
        parse_row_selection(options.rows, len(dataset.rows))
        if options.rows is not None
        else tuple(range(len(dataset.rows)))
    )
    items = [(row, run) for row in selected for run in range(options.n)]
    chat_models = await fetch_chat_models(options.chat_url, options.llm_api_key)
    if chat_models is None:
        stream.write(
            f"rollout-eval: warning: GET {options.chat_url.rstrip('/')}/models did not list any "
            "model; if the rollout server cannot reach --chat-url either, every rollout will "
            "fail as agent_error\n"
        )
    manifest = Manifest(
        inputs=RunInputs(
            dataset_sha256=dataset.sha256,
            rows=format_rows(selected),
            n=options.n,
            agent_timeout_sec=options.agent_timeout_sec,
            grader_timeout_sec=options.grader_timeout_sec,
        ),
        chat_models=chat_models,
        dataset_path=str(options.dataset),
        server_url=options.server_url,
        chat_url=options.chat_url,
        created_at=datetime.datetime.now(datetime.UTC).isoformat(),
        tool_version=__version__,
    )
    run_dir, warnings = _prepare_run_dir(options, manifest, stream)
    for warning in warnings:
        stream.write(f"rollout-eval: warning: {warning}\n")
    run_info: dict[str, Any] = {
        "name": options.run_name,
        "dataset": str(options.dataset),
        "dataset_sha256": dataset.sha256,
        "rows": format_rows(selected),
        "n": options.n,
        "server_url": options.server_url,
        **({"server_urls": list(options.server_urls)} if options.extra_server_urls else {}),
        "chat_url": options.chat_url,
        "chat_models": list(chat_models) if chat_models is not None else None,
    }
    with Journal(run_dir / "events.jsonl") as journal:
        latest = latest_by_item(journal.records)
        pending = [item for item in items if _pending(latest.get(item))]
        mode = Progress.resolve_mode(options.progress, stream)
        progress = Progress(
            total=len(items), stream=stream, mode=mode, interval_sec=options.progress_interval_sec
        )
        done_before = [latest[item] for item in items if not _pending(latest.get(item))]
        progress.preload(
            done=len(done_before),
            passed=sum(
                1
                for rec in done_before
                if rec.outcome == "success" and (rec.reward or 0.0) >= options.pass_threshold
            ),
            scored=sum(1 for rec in done_before if rec.outcome in ("success", "failed")),
            failed=sum(1 for rec in done_before if rec.outcome == "failed"),
        )
        if done_before:
            stream.write(
                f"rollout-eval: resuming run {options.run_name!r}: {len(done_before)} of "
                f"{len(items)} items done, {len(pending)} to run\n"
            )
        if pending:
            concurrency = await _run_pending(
                options=options,
                dataset=dataset,
                journal=journal,
                progress=progress,
                control=control,
                factory=factory,
                pending=pending,
                run_dir=run_dir,
            )
            run_info["concurrency"] = concurrency
            progress.close()
        records = list(journal.records)
    run_info["stopped"] = control.reason
    summary = summarize(
        records, items=items, n=options.n, pass_threshold=options.pass_threshold, run=run_info
    )
    write_summary(run_dir / "summary.json", summary)
    files = [str(run_dir / name) for name in ("summary.json", "events.jsonl", "samples.jsonl")]
    text = format_summary(summary, files=[f for f in files if Path(f).exists()])  # noqa: ASYNC240
    if control.interrupted:
        exit_code = EXIT_INTERRUPTED
    elif summary["complete"]:
        exit_code = EXIT_OK
    else:
        exit_code = EXIT_INCOMPLETE
    return EvalReport(
        run_dir=run_dir,
        summary=summary,
        exit_code=exit_code,
        stop_reason=control.reason,
        summary_text=text,
    )


def _pending(record: JournalRecord | None) -> bool:
    return record is None or record.outcome not in DONE_OUTCOMES


async def _run_pending(
    *,
    options: EvalOptions,
    dataset: Dataset,
    journal: Journal,
    progress: Progress,
    control: RunControl,
    factory: ClientFactory,
    pending: list[tuple[int, int]],
    run_dir: Path,
) -> int:
    urls = options.server_urls
    healths = []
    for url in urls:
        probe = factory(url=url, api_key=options.server_api_key)
        try:
            healths.append(await _check_server(probe, url))
        finally:
            await probe.aclose()
    for url, health in zip(urls, healths, strict=True):
        if not isinstance(health.get("process_id"), str):
            progress.message(
                f"rollout-eval: warning: GET {url}/health has no process_id: is "
                "--server a rollout server (rollout-server serve, or osmosis-ai >= 0.3.5)?"
            )
    capacities = [capacity_from_health(health) for health in healths]
    capacity = None if None in capacities else sum(c for c in capacities if c is not None)
    if options.concurrency is not None:
        concurrency = options.concurrency
    elif capacity is not None:
        concurrency = capacity
    else:
        concurrency = DEFAULT_CONCURRENCY_WITHOUT_LIMIT
        progress.message(
            "rollout-eval: the server reports no concurrency limit; running "
            f"{concurrency} at a time (set --concurrency to change)"
        )
    concurrency = min(concurrency, len(pending))
    admission = options.admission_timeout_sec or options.deadline_sec() * max(concurrency, 1)
    if len(urls) == 1:
        client = factory(
            url=urls[0], api_key=options.server_api_key, admission_timeout_sec=admission
        )

        def cancel_client() -> _Client:
            return factory(url=urls[0], api_key=options.server_api_key)
    else:
        client = factory(urls=urls, api_key=options.server_api_key, admission_timeout_sec=admission)

        def cancel_client() -> _Client:
            return client  # only the pool knows which server admitted each rollout

    run = _Run(
        options=options,
        dataset=dataset,
        journal=journal,
        progress=progress,
        client=client,
        cancel_client_factory=cancel_client,
        control=control,
        samples_path=run_dir / "samples.jsonl",
    )
    progress.message(
        f"rollout-eval: run {options.run_name!r}: {len(pending)} rollouts to run against "
        f"{', '.join(urls)}, {concurrency} at a time; results in {run_dir}"
    )
    try:
        progress.draw(force=True)
        await run.run_items(pending, concurrency)
    finally:
        try:
            await run.close()
        finally:
            await client.aclose()
    return concurrency
