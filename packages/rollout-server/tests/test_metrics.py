"""``GET /metrics``: the Prometheus metrics of a rollout server, over real HTTP.

Counters and histograms move where things happen (admissions, publications, collections,
cancellations, LocalBackend's phases); gauges are read at scrape time. Each server has its
own registry.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rollout_server import (
    AgentWorkflow,
    AgentWorkflowConfig,
    AgentWorkflowOutput,
    ExecutionOutcome,
    ExecutionResult,
    Grader,
    GraderContext,
    LocalBackend,
    WorkflowContext,
)
from rollout_types import RolloutErrorCategory, RolloutStatus

EVENT_SEC = 10.0

GATES: dict[str, asyncio.Event] = {}


def gate(key: str) -> asyncio.Event:
    return GATES.setdefault(key, asyncio.Event())


@pytest.fixture(autouse=True)
def _reset_gates() -> None:
    GATES.clear()


class Scrape:
    """One scrape of ``/metrics``, parsed by prometheus-client's own parser."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        self.families: set[str] = set()
        for family in text_string_to_metric_families(text):
            self.families.add(family.name)
            for sample in family.samples:
                key = (sample.name, frozenset(sample.labels.items()))
                self.samples[key] = sample.value

    def value(self, name: str, **labels: str) -> float:
        """The sample ``name{labels}``; KeyError if it is not exported."""
        return self.samples[(name, frozenset(labels.items()))]

    def has(self, name: str) -> bool:
        """Whether any sample is called ``name``."""
        return any(sample == name for sample, _labels in self.samples)


async def scrape(harness: Any, headers: dict[str, str] | None = None) -> Scrape:
    reply = await harness.request("GET", "/metrics", headers=headers)
    assert reply.status == 200, reply
    return Scrape(reply.raw.decode())


async def until_metric(harness: Any, predicate: Callable[[Scrape], bool]) -> Scrape:
    """Scrape until ``predicate`` holds (bounded)."""
    async with asyncio.timeout(EVENT_SEC):
        while True:
            scraped = await scrape(harness)
            if predicate(scraped):
                return scraped
            await asyncio.sleep(0.01)


class TestMetricsRoute:
    async def test_metrics_are_served_in_the_prometheus_text_format(self, harness: Any) -> None:
        """``GET /metrics`` answers 200 in the Prometheus text format, with the rollout
        families, the process families and the protocol header."""
        reply = await harness.request("GET", "/metrics")
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        assert "X-Rollout-Protocol-Version" in reply.headers
        scraped = Scrape(reply.raw.decode())
        for family in (
            "rollout_admissions",
            "rollout_finished",
            "rollout_in_progress",
            "rollout_results_uncollected",
            "rollout_long_polls_waiting",
            "rollout_queue_wait_seconds",
            "rollout_accepting",
            "rollout_server_info",
            "process_cpu_seconds",
        ):
            assert family in scraped.families, family
        assert scraped.value("rollout_accepting") == 1.0
        assert scraped.value("rollout_draining") == 0.0

    async def test_openmetrics_when_the_scraper_asks_for_it(self, harness: Any) -> None:
        """A scraper that accepts OpenMetrics gets that format (ending in ``# EOF``)."""
        reply = await harness.request(
            "GET", "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}
        )
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("application/openmetrics-text")
        assert reply.raw.decode().rstrip().endswith("# EOF")

    async def test_metrics_need_the_bearer_token(self, make_harness: Any) -> None:
        """With an api_key, ``/metrics`` answers 401 without the token and 200 with it."""
        harness = await make_harness(api_key="k")
        assert (await harness.request("GET", "/metrics")).status == 401
        scraped = await scrape(harness, {"Authorization": "Bearer k"})
        assert scraped.value("rollout_accepting") == 1.0

    async def test_metrics_false_turns_the_route_off(self, make_harness: Any) -> None:
        """``metrics=False``: ``/metrics`` is an unknown path and admissions still work."""
        harness = await make_harness(metrics=False)
        assert harness.server.metrics is None
        assert (await harness.request("GET", "/metrics")).status == 404
        await harness.admit("r1")

    async def test_each_server_counts_its_own(self, make_harness: Any) -> None:
        """Two servers in one process keep separate figures (no global registry)."""
        first = await make_harness()
        second = await make_harness()
        await first.admit("r1")
        await first.admit("r2")
        assert (await scrape(first)).value("rollout_admissions_total", code="202") == 2.0
        assert (await scrape(second)).value("rollout_admissions_total", code="202") == 0.0


class TestAdmissions:
    async def test_each_answer_is_counted_by_its_code(
        self, harness: Any, body: Callable[..., dict[str, Any]]
    ) -> None:
        """202, 409, 422, 400, 429 and 503 each count under their own ``code``."""
        await harness.admit("r1")
        assert (await harness.post_rollout(body("r1"))).status == 409
        assert (await harness.post_rollout({"rollout_id": 1})).status == 422
        callback = body("r2", completion_callback_url="http://127.0.0.1:9/cb")
        assert (await harness.post_rollout(callback)).status == 400
        harness.backend.capacity = False
        assert (await harness.post_rollout(body("r3"))).status == 429
        harness.server.begin_shutdown()
        assert (await harness.post_rollout(body("r4"))).status == 503
        scraped = await scrape(harness)
        for code in ("202", "409", "422", "400", "429", "503"):
            assert scraped.value("rollout_admissions_total", code=code) == 1.0, code
        assert scraped.value("rollout_admissions_total", code="413") == 0.0
        assert scraped.value("rollout_accepting") == 0.0

    async def test_a_body_over_the_limit_counts_as_413(self, make_harness: Any) -> None:
        """An admission refused for its size counts under 413."""
        harness = await make_harness(max_body_bytes=1024)
        reply = await harness.request("POST", "/rollout", data=b"x" * 4096)
        assert reply.status == 413
        assert (await scrape(harness)).value("rollout_admissions_total", code="413") == 1.0


class TestPublications:
    async def test_finished_rollouts_count_by_status_and_category(self, harness: Any) -> None:
        """Success, a categorised failure and a cancellation each count once under their
        status and category (``none`` without one)."""
        tokens = {rid: await harness.admit(rid) for rid in ("ok", "bad", "gone")}
        (await harness.backend.started("ok")).succeed()
        (await harness.backend.started("bad")).finish(
            ExecutionOutcome(
                workflow=ExecutionResult(
                    status=RolloutStatus.FAILURE,
                    err_message="no",
                    err_category=RolloutErrorCategory.HTTP_ERROR,
                )
            )
        )
        await harness.backend.started("gone")
        assert (await harness.cancel({"ids": ["gone"]})).status == 200
        for rid, token in tokens.items():
            await harness.poll_until(rid, token, "success", "failure", "cancelled")
        scraped = await scrape(harness)
        assert scraped.value("rollout_finished_total", status="success", category="none") == 1
        assert scraped.value("rollout_finished_total", status="failure", category="http_error") == 1
        assert scraped.value("rollout_finished_total", status="cancelled", category="none") == 1
        assert scraped.value("rollout_finished_total", status="failure", category="timeout") == 0
        assert scraped.value("rollout_admission_to_publication_seconds_count") == 3
        assert scraped.value("rollout_admission_to_collection_seconds_count") == 3
        assert scraped.value("rollout_cancellations_total", disposition="cancelled_running") == 1

    async def test_results_wait_to_be_collected_until_a_poll_returns_them(
        self, harness: Any
    ) -> None:
        """A published result counts as uncollected until the first poll returns it; a
        second poll changes nothing."""
        token = await harness.admit("r1")
        (await harness.backend.started("r1")).succeed()
        scraped = await until_metric(
            harness, lambda s: s.value("rollout_results_uncollected") == 1.0
        )
        assert scraped.value("rollout_admission_to_collection_seconds_count") == 0
        for _ in range(2):
            assert (await harness.poll("r1", token)).json["status"] == "success"
        scraped = await scrape(harness)
        assert scraped.value("rollout_results_uncollected") == 0.0
        assert scraped.value("rollout_admission_to_collection_seconds_count") == 1
        assert scraped.value("rollout_records") == 1.0

    async def test_an_expired_lease_counts_as_a_lease_expiry(self, make_harness: Any) -> None:
        """A rollout nobody polls within its lease counts as a lease expiry and as a
        ``failure`` / ``lease_expired``."""
        harness = await make_harness(result_wait_timeout_sec=0.05, polling_lease_timeout_sec=0.2)
        await harness.admit("r1")
        scraped = await until_metric(
            harness, lambda s: s.value("rollout_lease_expiries_total") == 1.0
        )
        assert (
            scraped.value("rollout_finished_total", status="failure", category="lease_expired")
            == 1.0
        )


class TestGauges:
    async def test_in_progress_counts_follow_the_status(
        self, queue_reporting: Any, make_harness: Any
    ) -> None:
        """Rollouts count under their current status: ``queued``, ``running``,
        ``grading``; once published, under none."""
        harness = await make_harness(backend=queue_reporting())
        for rid in ("a", "b", "c"):
            await harness.admit(rid)
        runs = {rid: await harness.backend.started(rid) for rid in ("a", "b", "c")}
        runs["a"].status("queued")
        runs["b"].status("running")
        runs["c"].status("grading")
        scraped = await scrape(harness)
        for status in ("queued", "running", "grading"):
            assert scraped.value("rollout_in_progress", status=status) == 1.0, status
        assert scraped.value("rollout_executions_active") == 3.0
        for run in runs.values():
            run.succeed()
        scraped = await until_metric(harness, lambda s: s.value("rollout_executions_active") == 0.0)
        for status in ("queued", "running", "grading"):
            assert scraped.value("rollout_in_progress", status=status) == 0.0, status

    async def test_waiting_long_polls_are_counted(self, make_harness: Any) -> None:
        """A long poll waiting on a running rollout counts until it is answered."""
        harness = await make_harness(result_wait_timeout_sec=5.0, polling_lease_timeout_sec=10.0)
        token = await harness.admit("r1")
        run = await harness.backend.started("r1")
        poll = asyncio.ensure_future(harness.poll("r1", token))
        try:
            await until_metric(harness, lambda s: s.value("rollout_long_polls_waiting") == 1.0)
            run.succeed()
            assert (await poll).json["status"] == "success"
        finally:
            if not poll.done():
                poll.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await poll
        assert (await scrape(harness)).value("rollout_long_polls_waiting") == 0.0

    async def test_draining_while_the_staged_shutdown_runs(self, harness: Any) -> None:
        """``rollout_draining`` is 1 (and ``rollout_accepting`` 0) while the drain waits for
        an active rollout, and 0 once it is over."""
        await harness.admit("r1")
        run = await harness.backend.started("r1")
        drain = asyncio.ensure_future(harness.server.drain(collect=False))
        try:
            await until_metric(
                harness,
                lambda s: (s.value("rollout_draining"), s.value("rollout_accepting")) == (1, 0),
            )
            run.succeed()
            async with asyncio.timeout(EVENT_SEC):
                await drain
        finally:
            if not drain.done():
                drain.cancel()
        assert (await scrape(harness)).value("rollout_draining") == 0.0

    async def test_a_backend_without_capacity_figures_exports_none(self, harness: Any) -> None:
        """A backend whose health has no ``concurrency`` exports no capacity gauges, and a
        failing ``health()`` does not fail the scrape."""
        assert not (await scrape(harness)).has("rollout_backend_slots")

        def broken() -> dict[str, Any]:
            raise RuntimeError("health broke")

        harness.backend.health = broken
        scraped = await scrape(harness)
        assert not scraped.has("rollout_backend_running")
        assert scraped.value("rollout_accepting") == 1.0


# -- LocalBackend's phases -----------------------------------------------------------------


class BlockingWorkflow(AgentWorkflow):
    """Signals ``started:<id>``, waits for the gate ``<id>``, then answers."""

    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        gate(f"started:{ctx.rollout_id}").set()
        await gate(ctx.rollout_id).wait()
        return AgentWorkflowOutput(messages=[*ctx.prompt, {"role": "assistant", "content": "4"}])


class OneGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        ctx.set_reward(1.0)


@pytest.fixture
async def local(make_harness: Any, tmp_path: Path) -> AsyncIterator[Any]:
    """A server over a LocalBackend with 1 slot and room for 1 queued rollout."""
    backend = LocalBackend(
        BlockingWorkflow,
        workflow_config=AgentWorkflowConfig(name="w", concurrency={"max_concurrent": 1}),
        grader=OneGrader,
        max_queued=1,
        artifact_root=tmp_path,
    )
    harness = await make_harness(backend=backend)
    yield harness
    for event in list(GATES.values()):
        event.set()


class TestLocalBackendPhases:
    async def test_capacity_and_every_phase_is_measured(self, local: Any) -> None:
        """Slots, running and queued rollouts and the queue bound come from the backend;
        queue wait, workflow, grading and trajectory write are each observed once per
        rollout."""
        tokens = {rid: await local.admit(rid) for rid in ("a", "b")}
        async with asyncio.timeout(EVENT_SEC):
            await gate("started:a").wait()
        scraped = await until_metric(local, lambda s: s.value("rollout_backend_queued") == 1.0)
        assert scraped.value("rollout_backend_slots") == 1.0
        assert scraped.value("rollout_backend_running") == 1.0
        assert scraped.value("rollout_backend_max_queued") == 1.0
        assert scraped.value("rollout_queue_wait_seconds_count") == 1.0
        gate("a").set()
        gate("b").set()
        for rid, token in tokens.items():
            reply = await local.poll_until(rid, token, "success", "failure", "cancelled")
            assert reply.json["status"] == "success", reply
        scraped = await scrape(local)
        for name in (
            "rollout_queue_wait_seconds",
            "rollout_workflow_seconds",
            "rollout_grading_seconds",
            "rollout_trajectory_write_seconds",
        ):
            assert scraped.value(f"{name}_count") == 2.0, name
        assert scraped.value("rollout_trajectory_write_failures_total") == 0.0
        assert scraped.value("rollout_queue_wait_seconds_sum") > 0.0

    async def test_a_failed_trajectory_write_is_counted(self, local: Any, tmp_path: Path) -> None:
        """A trajectory that cannot be written (its path is a directory) counts as a failed
        write; the rollout still succeeds."""
        (tmp_path / "r1" / "trajectory.json" / "occupied").mkdir(parents=True)
        token = await local.admit("r1")
        gate("r1").set()
        reply = await local.poll_until("r1", token, "success", "failure", "cancelled")
        assert reply.json["status"] == "success"
        scraped = await scrape(local)
        assert scraped.value("rollout_trajectory_write_failures_total") == 1.0
        assert scraped.value("rollout_trajectory_write_seconds_count") == 1.0
