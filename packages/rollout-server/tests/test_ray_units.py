"""RayBackend's parts that need no Ray: what travels between the server and a worker (the
codec derived from the attrs fields), the request the server builds from an admission,
the slot accounting of the worker pool, and the outcomes a worker that outlives its server
keeps for a restarted one."""

from __future__ import annotations

import asyncio
import time
import types
from typing import Any

import attrs
import pytest

from rollout_server import (
    AgentWorkflow,
    AgentWorkflowOutput,
    ExecutionOutcome,
    ExecutionRequest,
    ExecutionResult,
    Sample,
    WorkflowContext,
)
from rollout_server.execution._backend import (
    INIT_NAMES,
    REQUEST_FIELDS,
    SERVER_ONLY_INIT_FIELDS,
    SERVER_SET_FIELDS,
    request_from_init,
)
from rollout_server.observability._observer import NO_OBSERVER
from rollout_server.ray._codec import (
    PhaseTimes,
    decode_outcome,
    decode_request,
    encode_outcome,
    encode_request,
)
from rollout_server.ray._dispatch import PoolWorker
from rollout_server.ray._slots import WorkerSlots
from rollout_server.ray._worker import CANCELLED, Collected, RolloutWorker, WorkerSpec
from rollout_types import RolloutErrorCategory, RolloutInitRequest, RolloutStatus

EVENT_SEC = 5.0

FULL_REQUEST = ExecutionRequest(
    id="r1",
    prompt=[{"role": "user", "content": "6*7?"}],
    chat_completions_url="http://127.0.0.1:9/v1",
    llm_api_key="sk-test",
    label="42",
    metadata={"k": [1, 2]},
    grade=False,
    agent_timeout_sec=30.0,
    grader_timeout_sec=5.0,
    request_extra_fields={"x": "y"},
    admitted_at=123.0,
)


def _plain(value: Any) -> bool:
    """Whether ``value`` is made of JSON-like values only (what msgpack packs)."""
    if isinstance(value, tuple | list):
        return all(_plain(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and _plain(item) for key, item in value.items())
    return value is None or isinstance(value, str | int | float | bool)


class TestRequestFields:
    def test_every_admission_field_reaches_the_request(self) -> None:
        """Each field of RolloutInitRequest has a request field, and each request field
        that the server does not set itself comes from one."""
        init_fields = {field.name for field in attrs.fields(RolloutInitRequest)}
        mapped = {INIT_NAMES.get(name, name) for name in REQUEST_FIELDS}
        assert mapped == init_fields - SERVER_ONLY_INIT_FIELDS
        request_fields = {field.name for field in attrs.fields(ExecutionRequest)}
        assert set(REQUEST_FIELDS) == request_fields - SERVER_SET_FIELDS

    def test_request_from_init_copies_each_field(self) -> None:
        """The server's request carries every admission value and its own stamp, sink
        and observer."""
        init = RolloutInitRequest(
            initial_messages=FULL_REQUEST.prompt,
            rollout_id="r1",
            chat_completions_url=FULL_REQUEST.chat_completions_url,
            label="42",
            metadata={"k": [1, 2]},
            llm_api_key="sk-test",
            grade=False,
            agent_timeout_sec=30.0,
            grader_timeout_sec=5.0,
            extra_fields={"x": "y"},
        )
        statuses: list[RolloutStatus] = []
        request = request_from_init(
            init, admitted_at=123.0, on_status=statuses.append, observer=NO_OBSERVER
        )
        assert request == FULL_REQUEST
        assert request.llm_api_key == "sk-test"  # not compared: repr=False only
        request.on_status(RolloutStatus.RUNNING)
        assert statuses == [RolloutStatus.RUNNING]


class TestCodec:
    def test_a_request_travels_as_plain_values_and_back(self) -> None:
        """A request travels as plain values without the server's callbacks or stamp;
        the worker rebuilds it with its own, and gets the key and process id."""
        payload = encode_request(7, FULL_REQUEST, 1.5, "proc")
        assert payload[0] == 7
        assert _plain(payload)
        seen: list[RolloutStatus] = []
        request, process_id = decode_request(
            payload, lambda elapsed: 1000.0 - elapsed, seen.append, NO_OBSERVER
        )
        assert process_id == "proc"
        assert request.admitted_at == 998.5
        assert attrs.evolve(request, admitted_at=123.0) == FULL_REQUEST
        for name in REQUEST_FIELDS:
            assert getattr(request, name) == getattr(FULL_REQUEST, name), name
        request.on_status(RolloutStatus.GRADING)
        assert seen == [RolloutStatus.GRADING]

    def test_an_outcome_travels_without_what_stays_in_the_files(self) -> None:
        """Results and their samples come back field by field, without the diagnostics
        and the trajectory snapshot; the phase times come with them."""
        sample = Sample(
            messages=[{"role": "assistant", "content": "42"}],
            label="42",
            reward=0.5,
            remove_sample=True,
            metrics={"m": 1.0},
            extra_fields={"e": 1},
            trajectory_messages=[{"role": "user", "content": "kept on the worker"}],
        )
        outcome = ExecutionOutcome(
            workflow=ExecutionResult(status=RolloutStatus.SUCCESS, sample=sample),
            grader=ExecutionResult(
                status=RolloutStatus.FAILURE,
                err_message="grader broke",
                err_category=RolloutErrorCategory.AGENT_ERROR,
                extra_fields={"grader_error": {"traceback": "..."}},
            ),
        )
        times = PhaseTimes(workflow_sec=0.25, grading_sec=None, write_sec=0.01, write_failed=True)
        reply = encode_outcome(outcome, times)
        assert _plain(reply)
        decoded, decoded_times = decode_outcome(reply)
        assert attrs.asdict(decoded_times) == attrs.asdict(times)
        workflow = decoded.workflow
        assert workflow.status == RolloutStatus.SUCCESS
        assert workflow.sample is not None
        assert attrs.asdict(workflow.sample) == attrs.asdict(sample) | {"trajectory_messages": None}
        assert decoded.grader == attrs.evolve(outcome.grader, extra_fields=None)
        assert (
            decode_outcome(
                encode_outcome(ExecutionOutcome(workflow=outcome.workflow), PhaseTimes())
            )[0].grader
            is None
        )


def _workers(count: int) -> list[PoolWorker | None]:
    workers: list[PoolWorker | None] = []
    for index in range(count):
        worker = PoolWorker(index, types.SimpleNamespace(run=None))
        worker.ready = True
        workers.append(worker)
    return workers


class TestWorkerSlots:
    async def test_slots_go_to_the_least_loaded_live_worker(self) -> None:
        """take() fills the least-loaded live worker first and skips lost ones; the
        counts follow."""
        workers = _workers(3)
        lost = workers[2]
        assert lost is not None
        lost.lost = "gone"
        slots = WorkerSlots(workers, 2, asyncio.get_running_loop())
        taken = [slots.take() for _ in range(4)]
        assert [w.index for w in taken if w is not None] == [0, 1, 0, 1]
        assert slots.take() is None
        assert (slots.alive, slots.running, slots.capacity(), slots.free_slots()) == (2, 4, 4, 0)

    async def test_waiters_are_served_in_arrival_order_within_their_deadline(self) -> None:
        """A freed slot goes to the oldest waiter; a waiter whose deadline passes leaves
        the queue with nothing held."""
        workers = _workers(1)
        loop = asyncio.get_running_loop()
        slots = WorkerSlots(workers, 1, loop)
        held = slots.take()
        assert held is not None
        first = asyncio.create_task(slots.acquire(None))
        second = asyncio.create_task(slots.acquire(None))
        late = slots.acquire(loop.time() - 1.0)
        assert await asyncio.wait_for(late, EVENT_SEC) is None
        await asyncio.sleep(0)  # both waiters queue
        assert slots.queued == 2
        assert slots.take() is None  # others wait: no overtaking
        slots.release(held)
        assert await asyncio.wait_for(first, EVENT_SEC) is held
        assert not second.done()
        slots.release(held)
        assert await asyncio.wait_for(second, EVENT_SEC) is held
        assert (slots.queued, slots.running) == (0, 1)

    async def test_a_cancelled_waiter_holds_no_slot(self) -> None:
        """A waiter cancelled in the instant it was handed a slot passes the slot on."""
        workers = _workers(1)
        slots = WorkerSlots(workers, 1, asyncio.get_running_loop())
        held = slots.take()
        assert held is not None
        cancelled = asyncio.create_task(slots.acquire(None))
        after = asyncio.create_task(slots.acquire(None))
        await asyncio.sleep(0)
        slots.release(held)  # hands the slot to `cancelled`...
        cancelled.cancel()  # ...which is cancelled before it runs
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert await asyncio.wait_for(after, EVENT_SEC) is held
        assert slots.running == 1

    async def test_closing_ends_every_wait(self) -> None:
        """close() cancels the waiters and refuses new waits."""
        workers = _workers(1)
        slots = WorkerSlots(workers, 1, asyncio.get_running_loop())
        assert slots.take() is not None
        waiter = asyncio.create_task(slots.acquire(time.monotonic() + 60.0))
        await asyncio.sleep(0)
        slots.close()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        with pytest.raises(RuntimeError, match="pool is closed"):
            await slots.acquire(None)

    async def test_a_worker_that_starts_serving_takes_the_waiters(self) -> None:
        """hand_out() gives a new worker's slots to the oldest waiters; without a limit
        nobody waits."""
        workers: list[PoolWorker | None] = [None]
        slots = WorkerSlots(workers, 2, asyncio.get_running_loop())
        assert slots.take() is None
        assert slots.capacity() == 0
        waiter = asyncio.create_task(slots.acquire(None))
        await asyncio.sleep(0)
        workers[0] = _workers(1)[0]
        slots.hand_out()
        assert await asyncio.wait_for(waiter, EVENT_SEC) is workers[0]
        unlimited = WorkerSlots(_workers(1), None, asyncio.get_running_loop())
        assert all(unlimited.take() is not None for _ in range(10))
        assert (unlimited.capacity(), unlimited.free_slots()) == (None, None)


# -- outcomes kept by a worker that outlives its server --------------------------------

RELEASES: dict[str, asyncio.Event] = {}
STARTED: dict[str, asyncio.Event] = {}


class ReleasedWorkflow(AgentWorkflow):
    """Sets ``STARTED[id]``, waits for ``RELEASES[id]``, answers."""

    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        STARTED.setdefault(ctx.rollout_id, asyncio.Event()).set()
        await RELEASES.setdefault(ctx.rollout_id, asyncio.Event()).wait()
        return AgentWorkflowOutput(messages=[*ctx.prompt, {"role": "assistant", "content": "42"}])


def _keeping_worker(tmp_path: Any, keep: int) -> RolloutWorker:
    spec = WorkerSpec(
        workflow=ReleasedWorkflow,
        workflow_config=None,
        grader=None,
        grader_config=None,
        artifact_root=str(tmp_path),
    )
    return RolloutWorker(spec, keep_outcomes=keep)


def _payload(key: int, rollout_id: str) -> tuple[Any, ...]:
    return encode_request(key, attrs.evolve(FULL_REQUEST, id=rollout_id), 0.0, "proc")


async def _started(rollout_id: str) -> None:
    async with asyncio.timeout(EVENT_SEC):
        await STARTED.setdefault(rollout_id, asyncio.Event()).wait()


def _status_of(reply: Any) -> RolloutStatus:
    outcome, _times = decode_outcome(reply)
    return RolloutStatus(outcome.workflow.status)


class TestKeptOutcomes:
    @pytest.fixture(autouse=True)
    def _fresh_events(self) -> None:
        RELEASES.clear()
        STARTED.clear()

    async def test_latest_outcomes_are_kept_until_collected(self, tmp_path: Any) -> None:
        """A worker keeps the latest ``keep_outcomes`` outcomes by rollout id; collect()
        and wait() answer from them for as long as they are kept."""
        worker = _keeping_worker(tmp_path, keep=2)
        for key, rollout_id in enumerate(("a", "b", "c"), start=1):
            RELEASES.setdefault(rollout_id, asyncio.Event()).set()
            reply = await asyncio.wait_for(worker.run(_payload(key, rollout_id)), EVENT_SEC)
            assert _status_of(reply) == RolloutStatus.SUCCESS
        collected = await worker.collect(["a", "b", "c"])
        assert sorted(collected.finished) == ["b", "c"]
        assert all(_status_of(r) == RolloutStatus.SUCCESS for r in collected.finished.values())
        assert (collected.running, collected.cancelled) == ({}, 0)
        # Still kept: a server that crashes again before storing them collects them again.
        assert (await worker.collect(["b", "c"])).finished == collected.finished
        assert await worker.wait(99, "b") == collected.finished["b"]
        assert await worker.wait(99, "a") is None

    async def test_a_rollout_outlives_its_cancelled_call_and_is_waited_for_again(
        self, tmp_path: Any
    ) -> None:
        """The ``run`` call of a server that died is cancelled: the rollout runs on;
        collect() reports it running (key, payload) and cancels a rollout nobody asked
        for; wait() returns its outcome; an events() call of the old server ends empty."""
        worker = _keeping_worker(tmp_path, keep=8)
        kept_call = asyncio.create_task(worker.run(_payload(1, "kept")))
        orphan_call = asyncio.create_task(worker.run(_payload(2, "orphan")))
        await _started("kept")
        await _started("orphan")
        old_events = asyncio.create_task(worker.events())
        kept_call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await kept_call
        collected = await worker.collect(["kept", "gone"])
        assert isinstance(collected, Collected)
        assert collected.finished == {}
        assert collected.cancelled == 1
        key, payload, since, grading = collected.running["kept"]
        assert (key, payload, grading) == (1, _payload(1, "kept"), False)
        assert since >= 0.0
        assert await asyncio.wait_for(orphan_call, EVENT_SEC) == CANCELLED
        assert await asyncio.wait_for(old_events, EVENT_SEC) == []
        waiting = asyncio.create_task(worker.wait(1, "kept"))
        RELEASES.setdefault("kept", asyncio.Event()).set()
        assert _status_of(await asyncio.wait_for(waiting, EVENT_SEC)) == RolloutStatus.SUCCESS

    async def test_without_keeping_a_cancelled_call_stops_the_rollout(self, tmp_path: Any) -> None:
        """keep_outcomes=0 (a worker of one server process): as before, Ray's cancellation
        of the call stops the rollout and nothing is kept."""
        worker = _keeping_worker(tmp_path, keep=0)
        call = asyncio.create_task(worker.run(_payload(1, "x")))
        await _started("x")
        call.cancel()
        assert await asyncio.wait_for(call, EVENT_SEC) == CANCELLED
        assert (await worker.collect(["x"])).finished == {}
