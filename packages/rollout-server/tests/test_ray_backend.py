"""RayBackend on a real Ray cluster (127.0.0.1): dispatch, capacity, statuses, cancellation,
deadlines, and fault injection (SIGKILL of a worker, a removed node, a workflow that ignores
cancellation, one that blocks its worker, one that exhausts its memory).

Every test waits on events (bounded by ``asyncio.timeout``), never on timing; faults must
end every rollout with its documented status and category, once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from rollout_server import (
    AgentWorkflow,
    AgentWorkflowConfig,
    AgentWorkflowOutput,
    Grader,
    GraderContext,
    RayBackend,
    WorkflowContext,
)

ray = pytest.importorskip("ray")

COMMAND_LOOP_ONLY = True
"""Each test starts Ray workers: run once, on the command's loop (uvloop)."""

EVENT_SEC = 30.0
"""Bound on waiting for an event (a worker start, a death being noticed, a replacement)."""

TERMINAL = ("success", "failure", "cancelled")
ANSWER = {"role": "assistant", "content": "42"}

SHARED: dict[str, Any] = {}
"""``gates``: the test's :class:`Gates`, captured with the workflows shipped to workers."""


def gates() -> Any:
    return SHARED["gates"]


# -- workflows (shipped to the workers by value) ---------------------------------------


class AnswerWorkflow(AgentWorkflow):
    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        return AgentWorkflowOutput(messages=[*ctx.prompt, ANSWER])


class BlockingWorkflow(AgentWorkflow):
    """Records its pid, signals ``started:<id>``, waits for the gate ``<id>``; a cancellation
    seen sets ``cancelled:<id>``."""

    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        await gates().put(f"pid:{ctx.rollout_id}", os.getpid())
        gates().set(f"started:{ctx.rollout_id}")
        try:
            await gates().wait(ctx.rollout_id)
        except asyncio.CancelledError:
            gates().set(f"cancelled:{ctx.rollout_id}")
            raise
        return AgentWorkflowOutput(messages=[*ctx.prompt, ANSWER])


class StubbornWorkflow(AgentWorkflow):
    """Ignores every cancellation (it waits for the gate ``<id>`` again and again)."""

    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        gates().set(f"started:{ctx.rollout_id}")
        while True:
            try:
                await gates().wait(ctx.rollout_id)
            except asyncio.CancelledError:
                gates().set(f"cancelled:{ctx.rollout_id}")
                continue
            return AgentWorkflowOutput(messages=[*ctx.prompt, ANSWER])


class WedgingWorkflow(AgentWorkflow):
    """Blocks its worker's event loop (a synchronous wait) far beyond any deadline."""

    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        gates().set(f"started:{ctx.rollout_id}")
        time.sleep(120)  # noqa: ASYNC251 - blocking the worker's loop is the point
        return AgentWorkflowOutput(messages=[*ctx.prompt, ANSWER])


class GreedyWorkflow(AgentWorkflow):
    """Caps its worker's address space 256 MiB above what it uses, then allocates until
    that runs out; the cap is lifted again before the error propagates."""

    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        with open("/proc/self/statm", encoding="ascii") as statm:  # noqa: ASYNC230 - procfs
            used = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (used + 256 * 2**20, hard))
        hoard: list[bytearray] = []
        try:
            while True:
                hoard.append(bytearray(32 * 2**20))
        finally:
            hoard.clear()
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


class HalfGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        ctx.set_reward(0.5)


class BlockingGrader(Grader):
    """Signals ``grading:<id>`` and waits for the gate ``grader:<id>``."""

    async def grade(self, ctx: GraderContext) -> None:
        ctx.set_reward(0.25)
        gates().set(f"grading:{ctx.rollout_id}")
        await gates().wait(f"grader:{ctx.rollout_id}")


# -- fixtures and helpers --------------------------------------------------------------

Harness = Any
MakeHarness = Callable[..., Awaitable[Any]]


@pytest.fixture
def backend_kind() -> str:
    """This module always runs RayBackend (conftest's ``gates`` are remote then)."""
    return "ray"


@pytest.fixture(autouse=True)
def _ship(ray_cluster: Any, gates: Any) -> None:
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.cloudpickle.register_pickle_by_value(sys.modules[type(gates).__module__])
    SHARED["gates"] = gates


@pytest.fixture
async def serve(make_harness: MakeHarness, tmp_path: Path) -> AsyncIterator[Any]:
    """Factory: ``await serve(workflow, server=None, slots=2, **RayBackend_kwargs)`` serves
    a RayBackend (one worker with ``slots`` slots, files under ``tmp_path``, 1 s graces)
    through ``make_harness`` (``server``: its keyword arguments)."""

    async def make(
        workflow: Any, server: dict[str, Any] | None = None, slots: int = 2, **kwargs: Any
    ) -> Any:
        kwargs.setdefault("num_workers", 1)
        kwargs.setdefault("workflow_config", slot_config(slots))
        kwargs.setdefault("artifact_root", tmp_path)
        kwargs.setdefault("cancel_grace_sec", 1.0)
        kwargs.setdefault("deadline_grace_sec", 1.0)
        backend = RayBackend(workflow, **kwargs)
        return await make_harness(backend, **(server or {}))

    yield make
    for key in await gates().keys():
        gates().set(key)


def slot_config(slots: int | None) -> AgentWorkflowConfig:
    """A workflow config giving each worker ``slots`` slots."""
    return AgentWorkflowConfig(name="ray", concurrency={"max_concurrent": slots})


async def until_set(key: str) -> None:
    async with asyncio.timeout(EVENT_SEC):
        await gates().wait(key)


async def result_of(harness: Harness, rollout_id: str, token: str) -> dict[str, Any]:
    async with asyncio.timeout(EVENT_SEC):
        while True:
            reply = await harness.poll(rollout_id, token)
            assert reply.status == 200, reply
            if reply.json["status"] in TERMINAL:
                body: dict[str, Any] = reply.json
                return body


async def ray_health(harness: Harness, predicate: Callable[[dict[str, Any]], bool]) -> Any:
    """Read ``/health`` until ``predicate(body)`` holds (bounded); return the body."""
    async with asyncio.timeout(EVENT_SEC):
        while True:
            body = (await harness.health()).json
            if predicate(body):
                return body
            await asyncio.sleep(0.05)


def serving(expected_lost: int) -> Callable[[dict[str, Any]], bool]:
    """``/health`` shows every worker alive after ``expected_lost`` losses."""

    def check(body: dict[str, Any]) -> bool:
        ray_fields = body["ray"]
        return (
            ray_fields["lost"] == expected_lost
            and ray_fields["workers_alive"] == ray_fields["workers"]
        )

    return check


def _finished(record: logging.LogRecord) -> str:
    """``Rollout <id> finished: status=<status>`` of the registry's one finished line."""
    return record.getMessage().partition(" err_category=")[0]


def error_of(body: dict[str, Any]) -> tuple[str, str | None]:
    return body["status"], body["err_category"]


# -- tests -----------------------------------------------------------------------------


class TestDispatch:
    async def test_health_reports_the_pool(self, serve: Any) -> None:
        """/health has the pool: every worker alive with its pid, the slots, the cluster
        address, and LocalBackend's concurrency keys."""
        harness = await serve(AnswerWorkflow, num_workers=2)
        body = (await harness.health()).json
        assert body["status"] == "ok"
        assert body["concurrency"] == {
            "max_concurrent": 4,
            "queued": 0,
            "running": 0,
            "max_queued": None,
        }
        pool = body["ray"]
        assert pool["address"] == ray.get_runtime_context().gcs_address
        assert pool["namespace"] is None  # memory: state: anonymous workers of this process
        assert (pool["workers"], pool["workers_alive"], pool["free_slots"]) == (2, 2, 4)
        pids = [entry["pid"] for entry in pool["pool"]]
        assert len(set(pids)) == 2
        assert os.getpid() not in pids

    async def test_least_loaded_worker_gets_the_next_rollout(self, serve: Any) -> None:
        """Two rollouts on two idle workers land on different workers (not both in the
        first worker's free slots)."""
        harness = await serve(BlockingWorkflow, num_workers=2)
        for rollout_id in ("a", "b"):
            await harness.admit(rollout_id, grade=False)
            await until_set(f"started:{rollout_id}")
        assert await gates().get("pid:a") != await gates().get("pid:b")


class TestCapacity:
    async def test_queue_deadline_fails_without_reaching_a_worker(self, serve: Any) -> None:
        """A rollout whose agent deadline passes while it waits for a slot fails as timeout,
        saying how long it was queued, and never runs."""
        harness = await serve(BlockingWorkflow, slots=1)
        await harness.admit("a", grade=False)
        await until_set("started:a")
        token = await harness.admit("b", grade=False, agent_timeout_sec=0.3)
        result = await result_of(harness, "b", token)
        assert error_of(result) == ("failure", "timeout")
        assert result["err_message"].startswith("workflow exceeded its 0.3s deadline (")
        assert "spent queued" in result["err_message"]
        assert "started:b" not in await gates().keys()


class TestCancellation:
    async def test_cancel_reaches_the_workflow_and_frees_the_slot(self, serve: Any) -> None:
        """A cancelled rollout's workflow sees the cancellation on its worker; the result is
        cancelled, the slot is free and the worker stays (nothing was killed)."""
        harness = await serve(BlockingWorkflow)
        token = await harness.admit("a", grade=False)
        await until_set("started:a")
        reply = await harness.cancel({"ids": ["a"]})
        assert reply.json == {"dispositions": {"a": "cancelled_running"}}
        result = await result_of(harness, "a", token)
        assert (result["status"], result["err_message"]) == ("cancelled", "cancelled")
        await until_set("cancelled:a")
        health = (await harness.health()).json
        assert health["concurrency"]["running"] == 0
        assert health["ray"]["lost"] == 0

    async def test_lease_expiry_cancels_on_the_worker(self, serve: Any) -> None:
        """Without polls for the lease, the rollout fails as lease_expired and its workflow
        is cancelled on the worker."""
        harness = await serve(
            BlockingWorkflow,
            server={"result_wait_timeout_sec": 0.1, "polling_lease_timeout_sec": 0.5},
        )
        token = await harness.admit("a", grade=False)
        await until_set("cancelled:a")
        result = await result_of(harness, "a", token)
        assert error_of(result) == ("failure", "lease_expired")

    async def test_ignored_cancellation_kills_and_replaces_the_worker(
        self, serve: Any, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A workflow that ignores its cancellation is published as cancelled after the
        grace; its worker is killed, its other rollout fails as internal_error saying so,
        and a replacement serves the next rollout."""
        harness = await serve(StubbornWorkflow)
        stubborn = await harness.admit("a", grade=False)
        other = await harness.admit("b", grade=False)
        await until_set("started:a")
        await until_set("started:b")
        with caplog.at_level(logging.DEBUG, logger="rollout_server.registry"):
            await harness.cancel({"ids": ["a"]})
            result = await result_of(harness, "a", stubborn)
            assert (result["status"], result["err_message"]) == ("cancelled", "cancelled")
            failed = await result_of(harness, "b", other)
        assert error_of(failed) == ("failure", "internal_error")
        assert "rollout 'a' did not stop within 1s of its cancellation" in failed["err_message"]
        assert "not retried" in failed["err_message"]
        await until_set("cancelled:a")
        await ray_health(harness, serving(expected_lost=1))
        token = await harness.admit("c", grade=False)
        gates().set("c")
        assert (await result_of(harness, "c", token))["status"] == "success"
        finished = [_finished(r) for r in caplog.records if r.name == "rollout_server.registry"]
        assert sorted(finished) == [
            "Rollout a finished: status=cancelled",
            "Rollout b finished: status=failure",
        ]

    async def test_shutdown_stops_workflows_and_releases_the_workers(self, serve: Any) -> None:
        """The server's shutdown cancels the running workflow on its worker, publishes it
        as cancelled, and kills the worker processes."""
        harness = await serve(BlockingWorkflow)
        token = await harness.admit("a", grade=False)
        await until_set("started:a")
        pid = await gates().get("pid:a")
        async with asyncio.timeout(EVENT_SEC):
            await harness.server.drain(collect=False)
        assert (await result_of(harness, "a", token))["status"] == "cancelled"
        await until_set("cancelled:a")
        async with asyncio.timeout(EVENT_SEC):
            while _alive(pid):  # noqa: ASYNC110 - a process has no event to await
                await asyncio.sleep(0.05)


class TestShutdown:
    async def test_shutdown_says_what_it_waits_for(
        self, serve: Any, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Between "admissions closed" and "shutdown complete", RayBackend logs at INFO
        how many rollouts and workers it waits for, then that it stops the workers."""
        harness = await serve(AnswerWorkflow, num_workers=2)
        token = await harness.admit("a", grade=False)
        assert (await result_of(harness, "a", token))["status"] == "success"
        with caplog.at_level(logging.INFO, logger="rollout_server"):
            async with asyncio.timeout(EVENT_SEC):
                await harness.server.drain(collect=False)
        lines = [
            (record.name, record.levelno, record.getMessage())
            for record in caplog.records
            if record.name.rpartition(".")[2] in ("app", "ray_backend", "shutdown")
        ]
        closed = lines.index(
            ("rollout_server.app", logging.INFO, "Rollout server shutting down: admissions closed")
        )
        ray_lines = [line for line in lines[closed:] if line[0] == "rollout_server.ray_backend"]
        assert ray_lines == [
            (
                "rollout_server.ray_backend",
                logging.INFO,
                "RayBackend: waiting up to 5s for 0 rollout(s) and the file writes on 2 worker(s)",
            ),
            ("rollout_server.ray_backend", logging.INFO, "RayBackend: stopping 2 worker(s)"),
            ("rollout_server.ray_backend", logging.INFO, "RayBackend: shutdown complete"),
        ]
        assert lines[-1] == (
            "rollout_server.shutdown",
            logging.INFO,
            "Rollout server shutdown complete",
        )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class TestDeadlines:
    async def test_wedged_worker_is_timed_out_by_the_server(self, serve: Any) -> None:
        """A workflow that blocks its worker's loop past its deadline is published as
        timeout by the server after the grace; the wedged worker is killed and replaced."""
        harness = await serve(WedgingWorkflow, deadline_grace_sec=0.5, cancel_grace_sec=0.5)
        token = await harness.admit("a", grade=False, agent_timeout_sec=0.5)
        result = await result_of(harness, "a", token)
        assert error_of(result) == ("failure", "timeout")
        assert result["err_message"].startswith("workflow exceeded its 0.5s deadline, and Ray ")
        assert "did not report within 0.5s after it" in result["err_message"]
        await ray_health(harness, serving(expected_lost=1))

    async def test_worker_deadline_comes_first_when_the_worker_is_healthy(self, serve: Any) -> None:
        """A workflow past its deadline on a healthy worker gets LocalBackend's own timeout
        (with its trajectory), not the server's."""
        harness = await serve(BlockingWorkflow)
        token = await harness.admit("a", grade=False, agent_timeout_sec=0.2)
        result = await result_of(harness, "a", token)
        assert result["err_message"] == "workflow exceeded its 0.2s deadline"
        assert (await harness.health()).json["ray"]["lost"] == 0


class TestFaults:
    async def test_sigkill_of_a_worker_fails_its_rollouts_and_a_replacement_serves(
        self, serve: Any, caplog: pytest.LogCaptureFixture
    ) -> None:
        """SIGKILL of a worker mid-rollout fails each of its rollouts once, as
        internal_error naming the worker; a replacement serves the next rollout."""
        harness = await serve(BlockingWorkflow, grader=HalfGrader)
        tokens = {rid: await harness.admit(rid) for rid in ("a", "b")}
        for rollout_id in tokens:
            await until_set(f"started:{rollout_id}")
        pid = await gates().get("pid:a")
        assert pid == await gates().get("pid:b")
        caplog.set_level(logging.DEBUG, logger="rollout_server.registry")
        os.kill(pid, signal.SIGKILL)
        results = {rid: await result_of(harness, rid, tok) for rid, tok in tokens.items()}
        for result in results.values():
            assert error_of(result) == ("failure", "internal_error")
            assert f"Ray worker 0 (pid {pid} on 127.0.0.1) was lost" in result["err_message"]
            assert "ActorDiedError" in result["err_message"]
            assert result["sample"] is None
        await ray_health(harness, serving(expected_lost=1))
        token = await harness.admit("c")
        gates().set("c")
        assert (await result_of(harness, "c", token))["sample"]["reward"] == 0.5
        for rollout_id, token in tokens.items():  # still the same, once published
            assert (await harness.poll(rollout_id, token)).json == results[rollout_id]
        finished = [_finished(r) for r in caplog.records if r.name == "rollout_server.registry"]
        assert sorted(finished) == [
            "Rollout a finished: status=failure",
            "Rollout b finished: status=failure",
            "Rollout c finished: status=success",
        ]

    async def test_removed_node_fails_its_rollouts_and_the_worker_moves(
        self, serve: Any, ray_cluster: Any
    ) -> None:
        """Removing the node a worker runs on fails its rollouts as internal_error; the
        replacement starts on another node that has the resource and serves."""
        nodes = [ray_cluster.add_node(num_cpus=1, resources={"spot": 1}) for _ in range(2)]
        # A long lease: the cluster's calls below block the loop for seconds.
        harness = await serve(
            BlockingWorkflow,
            worker_options={"resources": {"spot": 1}},
            server={"polling_lease_timeout_sec": 120.0},
        )
        token = await harness.admit("a", grade=False)
        await until_set("started:a")
        (worker,) = (await harness.health()).json["ray"]["pool"]
        doomed = next(node for node in nodes if node.node_id == worker["node_id"])
        spare = next(node for node in nodes if node is not doomed)
        try:
            ray_cluster.remove_node(doomed, allow_graceful=False)
            result = await result_of(harness, "a", token)
            assert error_of(result) == ("failure", "internal_error")
            assert "was lost while running this rollout" in result["err_message"]
            await ray_health(harness, serving(expected_lost=1))
            token = await harness.admit("b", grade=False)
            gates().set("b")
            assert (await result_of(harness, "b", token))["status"] == "success"
        finally:
            await harness.server.drain(collect=False)
            ray_cluster.remove_node(spare, allow_graceful=False)
            async with asyncio.timeout(EVENT_SEC):  # no later test may land on them
                while any(node["Alive"] and node["Resources"].get("spot") for node in ray.nodes()):  # noqa: ASYNC110
                    await asyncio.sleep(0.1)

    async def test_workflow_exhausting_its_memory_fails_as_agent_error(self, serve: Any) -> None:
        """A workflow that allocates until its worker's address-space cap (RLIMIT_AS) runs
        out fails as agent_error with MemoryError's diagnostics; the worker serves on."""
        harness = await serve(GreedyWorkflow)
        token = await harness.admit("a", grade=False)
        result = await result_of(harness, "a", token)
        assert error_of(result) == ("failure", "agent_error")
        health = (await harness.health()).json
        assert (health["ray"]["lost"], health["ray"]["workers_alive"]) == (0, 1)


class TestConfiguration:
    def test_reserved_worker_options_are_refused(self) -> None:
        """Options the pool sets itself (retries, restarts, concurrency) are refused."""
        with pytest.raises(ValueError, match="must not set max_task_retries"):
            RayBackend(AnswerWorkflow, worker_options={"max_task_retries": 3})

    def test_slots_per_worker_are_local_backends(self) -> None:
        """Each worker has the slots a LocalBackend with the same config has: the config's
        max_concurrent, 4 without a config, no limit when the config sets none."""
        limited = AgentWorkflowConfig(name="x", concurrency={"max_concurrent": 6})
        unlimited = AgentWorkflowConfig(name="x", concurrency={"max_concurrent": None})
        assert RayBackend(AnswerWorkflow, workflow_config=limited).max_concurrent_per_worker == 6
        assert RayBackend(AnswerWorkflow).max_concurrent_per_worker == 4
        backend = RayBackend(AnswerWorkflow, workflow_config=unlimited)
        assert backend.max_concurrent_per_worker is None

    def test_arguments_are_checked_as_local_backend_checks_them(self) -> None:
        """A bad workflow, or max_queued without a slot limit, fails at construction with
        LocalBackend's message, before any Ray worker starts."""
        with pytest.raises(TypeError, match="must be a class, not an instance"):
            RayBackend(AnswerWorkflow(None))  # type: ignore[arg-type]  # the wrong use tested
        unlimited = AgentWorkflowConfig(name="x", concurrency={"max_concurrent": None})
        with pytest.raises(ValueError, match="needs a concurrency limit"):
            RayBackend(AnswerWorkflow, workflow_config=unlimited, max_queued=2)
