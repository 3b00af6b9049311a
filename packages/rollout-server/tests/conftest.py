"""Shared fixtures of rollout-server's tests.

* Every async test runs under the default event loop and under uvloop (when installed),
  through pytest-asyncio's ``pytest_asyncio_loop_factories`` hook.
* ``ScriptedBackend`` is an in-memory :class:`~rollout_server.ExecutionBackend` whose
  executions the test drives step by step (statuses, outcomes, crashes, cancellation).
* ``make_harness`` serves ``create_rollout_server()`` over real HTTP on 127.0.0.1 with
  short test timings and wraps the four routes.
* ``make_backend`` builds the real backend the run is for: ``LocalBackend`` by default,
  ``RayBackend`` with ``--backend=ray`` (the ``ray`` nox session), on one Ray cluster per
  test session (``ray_cluster``: a head node on 127.0.0.1 that tests may add nodes to).
  ``gates`` are named events and values the test shares with the workflows it serves, in
  process or across Ray workers.
"""

from __future__ import annotations

import asyncio
import faulthandler
import functools
import inspect
import os
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from rollout_server import (
    ROLLOUT_SERVER_KEY,
    ExecutionBackend,
    ExecutionOutcome,
    ExecutionRequest,
    ExecutionResult,
    LocalBackend,
    RayBackend,
    RolloutContext,
    RolloutServer,
    Sample,
    ShutdownTimeouts,
    create_rollout_server,
    current_rollout_context,
)
from rollout_types import LEASE_HEADER, RolloutStatus

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
    uvloop = None  # type: ignore[assignment]

_HERE = Path(__file__).resolve().parent

# Before anything imports Ray (its constants are read at import): every Ray process a test
# starts binds to 127.0.0.1 only.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

EVENT_SEC = 10.0
"""Upper bound on waiting for an event a test expects (never reached when all is well)."""

TEST_BODY_SEC = 60.0
"""Bound on the body of every async test: past it, the test fails with a clear message."""

TEST_WATCHDOG_SEC = 180.0
"""Bound on a whole test, setup and teardown included (an event loop that cannot close, a
task that swallows every cancellation): past it, every thread's stack is dumped and the
process exits, so a hang can never stall CI."""


def _bounded(test: Callable[..., Awaitable[Any]], nodeid: str) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(test)
    async def bounded_test(*args: Any, **kwargs: Any) -> Any:
        try:
            async with asyncio.timeout(TEST_BODY_SEC) as bound:
                return await test(*args, **kwargs)
        except TimeoutError:
            if bound.expired():
                pytest.fail(f"{nodeid} did not finish within {TEST_BODY_SEC:.0f}s", pytrace=False)
            raise

    return bounded_test


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--backend=local|ray``: the real backend that ``make_backend`` builds."""
    parser.addoption(
        "--backend",
        choices=("local", "ray"),
        default="local",
        help="backend of the backend-parametrized tests (ray needs rollout-server[ray])",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Bound the body of every async test of this directory by :data:`TEST_BODY_SEC`."""
    for item in items:
        obj = getattr(item, "obj", None)
        if (
            isinstance(item, pytest.Function)
            and inspect.iscoroutinefunction(obj)
            and not getattr(obj, "is_hypothesis_test", False)
            and item.path.resolve().parent == _HERE
        ):
            item.obj = _bounded(obj, item.nodeid)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    """Arm a watchdog over each whole test (setup, call, teardown): see
    :data:`TEST_WATCHDOG_SEC`."""
    armed = item.path.resolve().parent == _HERE and not item.config.getini("faulthandler_timeout")
    if armed:
        faulthandler.dump_traceback_later(TEST_WATCHDOG_SEC, exit=True, file=sys.stderr)
    try:
        return (yield)
    finally:
        if armed:
            faulthandler.cancel_dump_traceback_later()


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
    """Run every async test on the default loop and on uvloop.

    A test module that sets ``COMMAND_LOOP_ONLY = True`` (the command's tests, whose
    servers run in subprocesses), and every test of a ``--backend=ray`` run (each starts
    Ray workers), runs once, on the loop the command uses: uvloop.
    """
    factories: dict[str, Any] = {"asyncio": asyncio.new_event_loop}
    if uvloop is not None:
        factories["uvloop"] = uvloop.new_event_loop
        module = getattr(item, "module", None)
        if getattr(module, "COMMAND_LOOP_ONLY", False) or config.getoption("--backend") == "ray":
            del factories["asyncio"]
    return factories


def success(reward: float | None = 0.5, **fields: Any) -> ExecutionOutcome:
    """A graded, successful outcome whose sample carries ``reward``."""
    sample = Sample(messages=[{"role": "assistant", "content": "hi"}], reward=reward, **fields)
    return ExecutionOutcome(
        workflow=ExecutionResult(status=RolloutStatus.SUCCESS, sample=sample),
        grader=ExecutionResult(status=RolloutStatus.SUCCESS, sample=sample),
    )


class ScriptedRun:
    """One execution of :class:`ScriptedBackend`, driven by the test."""

    def __init__(self, request: ExecutionRequest, ignore_cancel: bool | int) -> None:
        self.request = request
        self.ignore_cancel = ignore_cancel
        """True: swallow every cancellation; an int: swallow that many."""
        self.cancels_seen = 0
        self.context: RolloutContext | None = current_rollout_context()
        self.started = asyncio.Event()
        self.cancel_seen = asyncio.Event()
        self.finished = asyncio.Event()
        self._release: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def status(self, status: RolloutStatus | str) -> None:
        """Report a progress status through the request's ``on_status``."""
        self.request.on_status(status)  # type: ignore[arg-type]

    def finish(self, outcome: Any) -> None:
        """Make ``execute()`` return ``outcome``."""
        if not self._release.done():
            self._release.set_result(outcome)

    def succeed(self, reward: float | None = 0.5, **fields: Any) -> None:
        """Make ``execute()`` return a successful outcome with ``reward``."""
        self.finish(success(reward, **fields))

    def raise_(self, exc: BaseException) -> None:
        """Make ``execute()`` raise ``exc``."""
        if not self._release.done():
            self._release.set_exception(exc)

    async def wait(self) -> Any:
        """The body of ``execute()``: wait for the test's decision."""
        try:
            while True:
                try:
                    return await asyncio.shield(self._release)
                except asyncio.CancelledError:
                    self.cancels_seen += 1
                    self.cancel_seen.set()
                    if self.ignore_cancel is True or self.cancels_seen <= self.ignore_cancel:
                        continue
                    raise
        finally:
            self.finished.set()


class ScriptedBackend(ExecutionBackend):
    """An in-memory backend: each execution waits until the test finishes it.

    Attributes:
        runs: The latest execution per rollout id.
        capacity: What ``has_capacity()`` answers.
        retry_after: What ``retry_after_sec()`` answers (or raises, if an exception).
        cancel_answers: What ``cancel_rollouts()`` returns (or raises, if an exception).
        cancel_calls: The ``ids`` of every ``cancel_rollouts()`` call.
        retained: What ``rollout_status(id)`` answers per id.
        health_fields: What ``health()`` answers.
        ignore_cancel: Whether new executions swallow cancellation (an int: how many
            cancellations each swallows).
    """

    def __init__(self, *, ignore_cancel: bool | int = False) -> None:
        self.runs: dict[str, ScriptedRun] = {}
        self.all_runs: list[ScriptedRun] = []
        self.capacity = True
        self.retry_after: Any = 5.0
        self.cancel_answers: Any = {}
        self.cancel_calls: list[list[str] | None] = []
        self.retained: dict[str, dict[str, Any]] = {}
        self.health_fields: Any = {"status": "ok", "scripted": True}
        self.ignore_cancel = ignore_cancel
        self.shutdown_calls = 0
        self.shutdown_hook: Callable[[], Awaitable[None]] | None = None
        self._started: dict[str, asyncio.Event] = {}

    async def execute(self, request: ExecutionRequest) -> ExecutionOutcome:
        run = ScriptedRun(request, self.ignore_cancel)
        self.runs[request.id] = run
        self.all_runs.append(run)
        run.started.set()
        self._started.setdefault(request.id, asyncio.Event()).set()
        result: ExecutionOutcome = await run.wait()
        return result

    async def started(self, rollout_id: str) -> ScriptedRun:
        """Wait (bounded) until the execution of ``rollout_id`` has started; return it."""
        event = self._started.setdefault(rollout_id, asyncio.Event())
        async with asyncio.timeout(EVENT_SEC):
            await event.wait()
        return self.runs[rollout_id]

    def release_all(self) -> None:
        """End every execution still waiting (a test's teardown): stop swallowing
        cancellation and return a ``cancelled`` outcome, so no task outlives its test."""
        for run in self.all_runs:
            run.ignore_cancel = False
            run.finish(ExecutionOutcome(workflow=ExecutionResult(status=RolloutStatus.CANCELLED)))

    def forget(self, rollout_id: str) -> None:
        """Forget that ``rollout_id`` started (before re-admitting it)."""
        self._started.pop(rollout_id, None)

    def has_capacity(self) -> bool:
        return self.capacity

    def retry_after_sec(self) -> float:
        if isinstance(self.retry_after, BaseException):
            raise self.retry_after
        value: float = self.retry_after
        return value

    def rollout_status(self, rollout_id: str) -> dict[str, Any] | None:
        return self.retained.get(rollout_id)

    async def cancel_rollouts(
        self, *, ids: list[str] | None = None, prefix: str | None = None, all: bool = False
    ) -> dict[str, str]:
        self.cancel_calls.append(ids)
        if isinstance(self.cancel_answers, BaseException):
            raise self.cancel_answers
        answers: dict[str, str] = self.cancel_answers
        return answers

    def health(self) -> dict[str, Any]:
        fields: dict[str, Any] = self.health_fields
        return fields

    async def shutdown(self) -> None:
        self.shutdown_calls += 1
        if self.shutdown_hook is not None:
            await self.shutdown_hook()


class QueueReportingBackend(ScriptedBackend):
    """A :class:`ScriptedBackend` that reports ``queued``/``running`` itself."""

    reports_queue_status = True


class Reply:
    """A response as the tests see it: status, headers and decoded JSON body."""

    def __init__(self, status: int, headers: Mapping[str, str], body: Any, raw: bytes) -> None:
        self.status = status
        self.headers = headers
        self.json = body
        self.raw = raw

    def __repr__(self) -> str:
        return f"<Reply {self.status} {self.raw[:200]!r}>"


def init_body(rollout_id: str = "r1", **fields: Any) -> dict[str, Any]:
    """A ``POST /rollout`` body as an osmosis-ai 0.3.8 client sends it (every key)."""
    body: dict[str, Any] = {
        "initial_messages": [{"role": "user", "content": "hello"}],
        "rollout_id": rollout_id,
        "chat_completions_url": "http://127.0.0.1:9/v1",
        "label": "L",
        "metadata": None,
        "llm_api_key": None,
        "grade": True,
        "agent_timeout_sec": None,
        "grader_timeout_sec": None,
        "extra_fields": None,
    }
    body.update(fields)
    return body


class Harness:
    """A rollout app served on 127.0.0.1, with one method per route."""

    def __init__(self, client: TestClient[Any, Any], backend: Any) -> None:
        self.client = client
        self.backend = backend
        app = client.app
        assert app is not None
        self.app: web.Application = app
        self.server: RolloutServer = app[ROLLOUT_SERVER_KEY]

    async def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        data: bytes | str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Reply:
        """Send one request and read the whole reply."""
        kwargs: dict[str, Any] = {"headers": dict(headers or {})}
        if data is not None:
            kwargs["data"] = data
        elif json_body is not None:
            kwargs["json"] = json_body
        async with self.client.request(method, path, **kwargs) as response:
            raw = await response.read()
            body: Any = None
            if response.content_type == "application/json":
                body = await response.json()
            return Reply(response.status, response.headers, body, raw)

    async def until(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds (checked every 10 ms, bounded by EVENT_SEC)."""
        async with asyncio.timeout(EVENT_SEC):
            while not predicate():  # noqa: ASYNC110 - plain state that has no event to await
                await asyncio.sleep(0.01)

    async def post_rollout(self, body: Any = None, **kwargs: Any) -> Reply:
        """``POST /rollout`` with ``body`` (default: :func:`init_body`)."""
        return await self.request("POST", "/rollout", json_body=body or init_body(), **kwargs)

    async def admit(self, rollout_id: str = "r1", **fields: Any) -> str:
        """Admit ``rollout_id`` (asserting 202) and return its lease token."""
        reply = await self.post_rollout(init_body(rollout_id, **fields))
        assert reply.status == 202, reply
        token: str = reply.json["polling_lease_token"]
        return token

    async def poll(
        self, rollout_id: str, token: str | None, *, headers: Mapping[str, str] | None = None
    ) -> Reply:
        """``GET /rollout/{rollout_id}/result`` with the lease ``token`` (None: no header)."""
        all_headers = dict(headers or {})
        if token is not None:
            all_headers[LEASE_HEADER] = token
        return await self.request("GET", f"/rollout/{rollout_id}/result", headers=all_headers)

    async def poll_until(self, rollout_id: str, token: str, *statuses: str) -> Reply:
        """Long-poll until the status is one of ``statuses`` (bounded); return that reply."""
        async with asyncio.timeout(EVENT_SEC):
            while True:
                reply = await self.poll(rollout_id, token)
                assert reply.status == 200, reply
                if reply.json["status"] in statuses:
                    return reply

    async def cancel(self, body: Any, **kwargs: Any) -> Reply:
        """``POST /rollout/cancel`` with ``body``."""
        return await self.request("POST", "/rollout/cancel", json_body=body, **kwargs)

    async def health(self, **kwargs: Any) -> Reply:
        """``GET /health``."""
        return await self.request("GET", "/health", **kwargs)


TEST_SHUTDOWN = ShutdownTimeouts(
    drain_sec=0.1, cleanup_sec=2.0, force_sec=1.0, backend_sec=2.0, collect_sec=0.5
)
"""Short shutdown stages, so a test's teardown never waits long."""


MakeHarness = Callable[..., Awaitable[Harness]]


@pytest.fixture
async def make_harness(aiohttp_client: Any) -> AsyncIterator[MakeHarness]:
    """Factory: ``await make_harness(backend=None, **create_rollout_server_kwargs)``.

    Defaults for tests: a 0.3 s long-poll wait, a 5 s lease, 60 s retention and short
    shutdown stages. ``backend`` is any execution backend (default: a fresh
    :class:`ScriptedBackend`). At teardown, every backend with a ``release_all()`` (the
    scripted ones) releases the executions still waiting before the app stops, so a
    backend that swallows cancellation cannot hang the test.
    """
    backends: list[Any] = []

    async def make(backend: Any = None, **kwargs: Any) -> Harness:
        backend = ScriptedBackend() if backend is None else backend
        backends.append(backend)
        kwargs.setdefault("result_wait_timeout_sec", 0.3)
        kwargs.setdefault("polling_lease_timeout_sec", 5.0)
        kwargs.setdefault("result_retention_sec", 60.0)
        kwargs.setdefault("shutdown_timeouts", TEST_SHUTDOWN)
        app = create_rollout_server(backend=backend, **kwargs)
        client = await aiohttp_client(app)
        return Harness(client, backend)

    yield make
    for backend in backends:
        release_all = getattr(backend, "release_all", None)
        if release_all is not None:
            release_all()


@pytest.fixture
async def harness(make_harness: MakeHarness) -> Harness:
    """A harness with the default test settings and a fresh :class:`ScriptedBackend`."""
    return await make_harness()


@pytest.fixture
def scripted() -> type[ScriptedBackend]:
    """The :class:`ScriptedBackend` class (test files cannot import conftest)."""
    return ScriptedBackend


@pytest.fixture
def queue_reporting() -> type[QueueReportingBackend]:
    """The :class:`QueueReportingBackend` class."""
    return QueueReportingBackend


@pytest.fixture
def body() -> Callable[..., dict[str, Any]]:
    """:func:`init_body`: ``body(rollout_id="r1", **fields)``."""
    return init_body


@pytest.fixture
def outcome_success() -> Callable[..., ExecutionOutcome]:
    """:func:`success`: ``outcome_success(reward=0.5, **sample_fields)``."""
    return success


# -- real backends: LocalBackend, or RayBackend on the session's Ray cluster ---------------

RAY_HEAD_CPUS = 4
"""Logical CPUs of the session cluster's head node (actors ask for 1 each; oversubscribing
the 2 real cores is fine for tests)."""


RAY_TEST_SYSTEM_CONFIG: dict[str, Any] = {
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
}
"""A removed node is marked dead within about 2 s (Ray's default is about 15 s), so a
replacement worker never waits for a dead node that still counts as alive."""


@pytest.fixture(scope="session")
def backend_kind(pytestconfig: pytest.Config) -> str:
    """``"local"`` or ``"ray"`` (the ``--backend`` option)."""
    kind: str = pytestconfig.getoption("--backend")
    return kind


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """One Ray cluster for the whole session, on 127.0.0.1: a head node that tests may add
    nodes to (``ray.cluster_utils.Cluster``). Stopped by ``ray.shutdown()`` and the
    cluster's own shutdown (its processes, by their handles)."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": RAY_HEAD_CPUS,
            "resources": {"head": 1},
            "include_dashboard": False,
            "_system_config": RAY_TEST_SYSTEM_CONFIG,
        },
    )
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


class GateKeeper:
    """The Ray actor behind remote :class:`Gates`: events and values by key."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}
        self._values: dict[str, Any] = {}

    def _event(self, key: str) -> asyncio.Event:
        return self._events.setdefault(key, asyncio.Event())

    async def set(self, key: str) -> None:
        self._event(key).set()

    async def wait(self, key: str) -> None:
        await self._event(key).wait()

    async def is_set(self, key: str) -> bool:
        return key in self._events and self._events[key].is_set()

    async def keys(self) -> list[str]:
        return list(self._events)

    async def put(self, key: str, value: Any) -> None:
        self._values[key] = value

    async def get(self, key: str) -> Any:
        return self._values.get(key)


class Gates:
    """Named events and values shared by a test and the workflows it serves.

    In process (LocalBackend) they are plain asyncio events; with ``actor`` (RayBackend)
    they live in a named Ray actor, so a workflow in any worker process sees the test's
    ``set()`` and the test sees the workflow's ``put()``. ``set()`` does not wait (calls
    from one process reach the actor in order).
    """

    def __init__(self, actor: str | None = None) -> None:
        self._actor_name = actor
        self._events: dict[str, asyncio.Event] = {}
        self._values: dict[str, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        # Only remote gates travel (to Ray workers); their state is the actor's name.
        return {"_actor_name": self._actor_name, "_events": {}, "_values": {}}

    def _actor(self) -> Any:
        import ray

        return ray.get_actor(self._actor_name)

    def set(self, key: str) -> None:
        """Set the event ``key``."""
        if self._actor_name is None:
            self._events.setdefault(key, asyncio.Event()).set()
        else:
            self._actor().set.remote(key)

    async def wait(self, key: str) -> None:
        """Wait until the event ``key`` is set (unbounded: bound it in the caller)."""
        if self._actor_name is None:
            await self._events.setdefault(key, asyncio.Event()).wait()
        else:
            await self._actor().wait.remote(key)

    async def keys(self) -> list[str]:
        """Every key that was set or waited for."""
        if self._actor_name is None:
            return list(self._events)
        keys: list[str] = await self._actor().keys.remote()
        return keys

    async def put(self, key: str, value: Any) -> None:
        """Store ``value`` under ``key``."""
        if self._actor_name is None:
            self._values[key] = value
        else:
            await self._actor().put.remote(key, value)

    async def get(self, key: str) -> Any:
        """The value stored under ``key``, or None."""
        if self._actor_name is None:
            return self._values.get(key)
        return await self._actor().get.remote(key)

    def open_all(self) -> None:
        """Set every local event (a test's teardown; remote gates die with their actor)."""
        for event in self._events.values():
            event.set()


@pytest.fixture
def gates(request: pytest.FixtureRequest, backend_kind: str) -> Iterator[Gates]:
    """Fresh :class:`Gates` for one test, remote when the backend is Ray."""
    if backend_kind == "local":
        local = Gates()
        yield local
        local.open_all()
        return
    import ray

    request.getfixturevalue("ray_cluster")
    name = f"gates-{uuid.uuid4().hex}"
    # On the head node, which no test removes.
    actor = ray.remote(GateKeeper).options(name=name, num_cpus=0, resources={"head": 0.01}).remote()
    try:
        yield Gates(name)
    finally:
        ray.kill(actor)


MakeBackend = Callable[..., Any]


def ship_by_value(*modules: ModuleType) -> None:
    """Let Ray workers receive classes and functions of ``modules`` by value (test modules
    are not importable by name in a worker)."""
    import ray

    for module in modules:
        ray.cloudpickle.register_pickle_by_value(module)


@pytest.fixture
def make_backend(request: pytest.FixtureRequest, backend_kind: str) -> MakeBackend:
    """Factory: ``make_backend(workflow, **LocalBackend_kwargs)`` builds a LocalBackend, or
    with ``--backend=ray`` a RayBackend with the same settings (one worker whose slots are
    the config's ``max_concurrent``) on the session cluster. Ray-only keyword arguments
    (``ray={...}``) are ignored for LocalBackend."""

    def make(workflow: Any, *, ray: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
        if backend_kind == "local":
            return LocalBackend(workflow, **kwargs)
        request.getfixturevalue("ray_cluster")
        ship_by_value(sys.modules[__name__], request.module)
        options = {"num_workers": 1, **(ray or {})}
        return RayBackend(workflow, **kwargs, **options)

    return make


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    """An aiohttp client session for talking to a server the test started (a subprocess)."""
    async with aiohttp.ClientSession() as client_session:
        yield client_session
