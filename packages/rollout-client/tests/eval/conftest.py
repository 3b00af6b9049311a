"""Stand-ins for a rollout server: an in-memory server and client for the runner's unit
tests, and a scripted rollout server on 127.0.0.1 for tests with the real client."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from rollout_client import RetrySettings
from rollout_types import RolloutResultResponse, RolloutSample

Behaviour = Callable[[dict[str, Any], asyncio.Event], Awaitable[RolloutResultResponse]]


def success(rollout_id: str, reward: float, *, remove: bool = False) -> RolloutResultResponse:
    """A ``success`` result with ``reward``."""
    return RolloutResultResponse(
        rollout_id=rollout_id,
        status="success",
        sample=RolloutSample(
            messages=[{"role": "assistant", "content": "x"}],
            reward=None if remove else reward,
            remove_sample=remove,
        ),
    )


def failure(rollout_id: str, category: str | None, message: str) -> RolloutResultResponse:
    """A ``failure`` result."""
    return RolloutResultResponse(
        rollout_id=rollout_id, status="failure", err_category=category, err_message=message
    )


class FakeHandle:
    """Awaitable like ``RolloutHandle``: resolves to the behaviour's result."""

    def __init__(self, rollout_id: str, task: asyncio.Task[RolloutResultResponse]) -> None:
        self.rollout_id = rollout_id
        self._task = task

    def __await__(self) -> Generator[Any, None, RolloutResultResponse]:
        return asyncio.shield(self._task).__await__()

    def cancel(self) -> bool:
        return self._task.cancel()

    def done(self) -> bool:
        return self._task.done()


class FakeServer:
    """Runs each admitted rollout's behaviour as a task; records requests and cancels."""

    def __init__(
        self,
        behaviour: Behaviour,
        *,
        health: dict[str, Any] | None = None,
        admit: Callable[[dict[str, Any]], None] | None = None,
        admit_gate: asyncio.Event | None = None,
    ) -> None:
        self.behaviour = behaviour
        self.admit = admit
        self.admit_gate = admit_gate
        self.health_body = health or {
            "status": "ok",
            "concurrency": {"max_concurrent": 3, "queued": 0, "running": 0},
        }
        self.requests: list[dict[str, Any]] = []
        self.cancel_requests: list[str] = []
        self.cancel_events: dict[str, asyncio.Event] = {}
        self.in_flight = 0
        self.max_in_flight = 0
        self.client_kwargs: list[dict[str, Any]] = []
        self.closed = 0
        self.cancel_error: Exception | None = None
        """Raised by every cancel_rollout() after the cancel took effect (a lost answer)."""

    def factory(self, **kwargs: Any) -> FakeClient:
        self.client_kwargs.append(kwargs)
        return FakeClient(self)

    async def _run(self, request: dict[str, Any]) -> RolloutResultResponse:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self.behaviour(request, self.cancel_events[request["rollout_id"]])
        finally:
            self.in_flight -= 1


class FakeClient:
    """The subset of ``RolloutClient`` the runner uses."""

    def __init__(self, server: FakeServer) -> None:
        self.server = server

    async def health(self) -> dict[str, Any]:
        return self.server.health_body

    async def run_rollout_async(self, **request: Any) -> FakeHandle:
        if self.server.admit is not None:
            self.server.admit(request)
        if self.server.admit_gate is not None:
            await self.server.admit_gate.wait()
        self.server.requests.append(request)
        self.server.cancel_events[request["rollout_id"]] = asyncio.Event()
        task = asyncio.get_running_loop().create_task(self.server._run(request))
        return FakeHandle(request["rollout_id"], task)

    async def cancel_rollout(self, rollout_id: str) -> dict[str, str]:
        self.server.cancel_requests.append(rollout_id)
        self.server.cancel_events[rollout_id].set()
        if self.server.cancel_error is not None:
            raise self.server.cancel_error
        return {rollout_id: "cancelled_running"}

    async def aclose(self) -> None:
        self.server.closed += 1


async def until_cancelled(
    request: dict[str, Any], cancelled: asyncio.Event
) -> RolloutResultResponse:
    """A rollout that runs until the server is asked to cancel it."""
    await cancelled.wait()
    return RolloutResultResponse(rollout_id=request["rollout_id"], status="cancelled")


@pytest.fixture
def fakes() -> types.SimpleNamespace:
    """The fake server, client and result builders of this module."""
    return types.SimpleNamespace(
        FakeServer=FakeServer,
        success=success,
        failure=failure,
        until_cancelled=until_cancelled,
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "real_outage_schedule: keep rollout-eval's 16.6 s outage retry schedule"
    )


@pytest.fixture(autouse=True)
def short_outage_schedule(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Give in-process runs the protocol's short transport schedule (0.1 and 0.5 s) instead
    of the 16.6 s outage schedule, so tests of failing servers stay quick; the tests marked
    ``real_outage_schedule`` (test_outage.py) keep the real one."""
    if request.node.get_closest_marker("real_outage_schedule") is not None:
        return
    monkeypatch.setattr("rollout_client.eval._client_seam.OUTAGE_RETRY", RetrySettings())
    monkeypatch.setattr("rollout_client.eval._scheduler.ADMISSION_OUTAGE_DELAYS_SEC", (0.1, 0.5))


def write_dataset(path: Path, rows: list[dict[str, Any]]) -> Path:
    """Write ``rows`` as a JSONL dataset."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    """A valid five-row JSONL dataset (labels "0" .. "4")."""
    return write_dataset(
        tmp_path / "tiny.jsonl",
        [{"user_prompt": f"What is {i} + 0?", "label": str(i)} for i in range(5)],
    )


# -- a scripted rollout server on 127.0.0.1, for the real RolloutClient --------------------


class Watched(io.StringIO):
    """A progress stream that sets ``seen`` once a write contains ``marker``."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker
        self.seen = asyncio.Event()

    def write(self, text: str) -> int:
        if self.marker in text:
            self.seen.set()
        return super().write(text)


Admit = Callable[[str], "web.StreamResponse | None"]
"""What the scripted server answers to ``POST /rollout`` for a label: None admits (202)."""
Outcome = Callable[[str], "dict[str, Any] | None"]
"""The result fields for a label, or None while the rollout runs."""


def result_fields(kind: str) -> dict[str, Any]:
    """Result fields by name: ``pass`` (reward 1), ``wrong`` (reward 0), ``no-reward``,
    ``removed`` (``remove_sample``), ``cancelled``, ``drop`` (no result: the poll's
    connection is closed), or a failure category (``none`` for a failure without one)."""
    if kind == "drop":
        return {"drop": True}
    sample = {"messages": [{"role": "assistant", "content": "x"}], "remove_sample": False}
    if kind in ("pass", "wrong", "no-reward"):
        reward = {"pass": 1.0, "wrong": 0.0, "no-reward": None}[kind]
        return {"status": "success", "sample": {**sample, "reward": reward}}
    if kind == "removed":
        return {"status": "success", "sample": {**sample, "reward": None, "remove_sample": True}}
    if kind == "cancelled":
        return {"status": "cancelled", "err_message": "cancelled"}
    category = None if kind == "none" else kind
    return {"status": "failure", "err_category": category, "err_message": f"{kind} happened"}


class RolloutScript:
    """A rollout server whose answers the test scripts by dataset label.

    ``admit(label)`` answers ``POST /rollout`` (None: 202); ``outcome(label)`` gives the
    result fields once the rollout is over (None: still running; a long poll then waits
    for :meth:`changed` or ``WAIT_SEC``; ``{"drop": True}`` closes the poll's connection,
    a transport error); the default is :func:`result_fields`. Records the labels posted
    (admitted or refused), in order, and the ids cancelled; a cancelled rollout reports
    ``cancelled``.
    """

    WAIT_SEC = 0.2

    def __init__(self, *, admit: Admit | None = None, outcome: Outcome | None = None) -> None:
        self.admit = admit or (lambda _label: None)
        self.outcome = outcome or result_fields
        self.url = ""
        self.posted: list[str] = []
        self.admitted: dict[str, str] = {}
        self.cancelled: list[str] = []
        self.site: web.TCPSite | None = None
        self.crashed = False
        self._changed = asyncio.Event()

    def crash(self) -> None:
        """Behave like a server process that died: new connections are refused, and every
        request on a connection still open (a long poll waiting) has it closed."""
        self.crashed = True
        assert self.site is not None
        listener = self.site._server
        assert listener is not None
        listener.close()
        self.changed()

    def changed(self) -> None:
        """Wake the long polls: an outcome may have changed."""
        self._changed.set()
        self._changed = asyncio.Event()

    def app(self) -> web.Application:
        @web.middleware
        async def dead(request: web.Request, handler: Any) -> web.StreamResponse:
            response: web.StreamResponse = await handler(request)
            if self.crashed:
                assert request.transport is not None
                request.transport.close()
            return response

        app = web.Application(middlewares=[dead])
        app.router.add_get("/health", self._health)
        app.router.add_post("/rollout", self._post)
        app.router.add_get("/rollout/{rollout_id}/result", self._result)
        app.router.add_post("/rollout/cancel", self._cancel)
        return app

    async def _health(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {"status": "ok", "process_id": "p1", "concurrency": {"max_concurrent": 2}}
        )

    async def _post(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        label = str(body["label"])
        self.posted.append(label)
        refused = self.admit(label)
        if refused is not None:
            return refused
        rollout_id = body["rollout_id"]
        self.admitted[rollout_id] = label
        return web.json_response(
            {
                "rollout_id": rollout_id,
                "status": "queued",
                "polling_lease_token": "tok",
                "result_wait_timeout_sec": self.WAIT_SEC,
                "polling_lease_timeout_sec": 60.0,
            },
            status=202,
        )

    async def _result(self, request: web.Request) -> web.StreamResponse:
        rollout_id = request.match_info["rollout_id"]
        label = self.admitted[rollout_id]
        fields = self._fields(rollout_id, label)
        if fields is None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.WAIT_SEC):
                    await self._changed.wait()
            fields = self._fields(rollout_id, label) or {"status": "running"}
        if fields.get("drop"):
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        body = {"sample": None, "err_message": None, "err_category": None, **fields}
        return web.json_response({"rollout_id": rollout_id, **body})

    def _fields(self, rollout_id: str, label: str) -> dict[str, Any] | None:
        if rollout_id in self.cancelled:
            return result_fields("cancelled")
        return self.outcome(label)

    async def _cancel(self, request: web.Request) -> web.Response:
        ids = (await request.json())["ids"]
        self.cancelled.extend(ids)
        self.changed()
        return web.json_response({"dispositions": dict.fromkeys(ids, "cancelled_running")})


@pytest.fixture
async def rollout_script() -> AsyncIterator[Callable[..., Awaitable[RolloutScript]]]:
    """Start scripted rollout servers on 127.0.0.1: ``await rollout_script(admit=...,
    outcome=...)`` (see :class:`RolloutScript`); stopped at teardown."""
    runners: list[web.AppRunner] = []

    async def start(**script_args: Any) -> RolloutScript:
        script = RolloutScript(**script_args)
        runner = web.AppRunner(script.app(), handle_signals=False, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        script.site = site
        runners.append(runner)
        host, port = runner.addresses[0][:2]
        script.url = f"http://{host}:{port}"
        return script

    yield start
    for runner in runners:
        await runner.cleanup()
