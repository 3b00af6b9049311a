"""Checked by mypy (``nox -s typecheck``), never run: the public API types as documented."""

from __future__ import annotations

from rollout_types import (
    RolloutInitRequest,
    RolloutResultResponse,
    RolloutStatus,
    converter,
    dumps,
    structure_wire,
)

request = RolloutInitRequest(
    initial_messages=[{"role": "user", "content": "hi"}],
    rollout_id="r1",
    chat_completions_url="http://127.0.0.1:9000/v1",
)
payload: str = dumps(request)
result: RolloutResultResponse = structure_wire({}, RolloutResultResponse)
terminal: bool = result.is_terminal
status: RolloutStatus | str = result.status
document: object = converter.unstructure(request)


# -- rollout_client: the user guide's calls, with an aiohttp session ------------------------
async def _client_usage() -> None:
    import aiohttp

    from rollout_client import (
        RetrySettings,
        RolloutAdmissionTimeoutError,
        RolloutClient,
        RolloutHandle,
        RolloutProtocolError,
    )
    from rollout_client.testing import override_timing

    retry = RetrySettings(gateway_delays_sec=(0.5, 1.0), gateway_statuses={502, 503})
    delays: tuple[float, ...] = retry.transport_delays_sec
    async with aiohttp.ClientSession() as session:
        client = RolloutClient(
            url="http://127.0.0.1:8000", http_client=session, api_key="k", retry=retry
        )

        async def instant(delay_sec: float) -> None:
            del delay_sec

        override_timing(client, sleep=instant, result_read_grace_sec=0.5)
        final: RolloutResultResponse = await client.run_rollout(
            initial_messages=[{"role": "user", "content": "What is 6 * 7?"}],
            chat_completions_url="http://127.0.0.1:9000/v1",
            rollout_id="r1",
            label="42",
            grade=True,
        )
        handle: RolloutHandle = await client.run_rollout_async(
            initial_messages=[], chat_completions_url="", rollout_id="r2"
        )
        phase: RolloutStatus | str = await handle.wait_for_grading()
        latest: RolloutResultResponse | None = handle.latest_result
        awaited: RolloutResultResponse = await handle
        health: dict[str, object] = await client.wait_idle(timeout_sec=120, process_id="p")
        code: int = RolloutProtocolError("x", status_code=500).status_code
        timeout_error: TimeoutError = RolloutAdmissionTimeoutError(
            "x", rollout_id="r1", may_have_succeeded=False
        )
        del final, phase, latest, awaited, health, code, timeout_error, delays


async def _pool_usage() -> None:
    from rollout_client import (
        PoolServerStatus,
        RetrySettings,
        RolloutClientPool,
        RolloutHandle,
        RolloutNotFoundError,
        RolloutServersUnavailableError,
    )
    from rollout_client.testing import override_timing
    from rollout_types import CancelRolloutsResponse

    async with RolloutClientPool(
        urls=["http://10.0.0.1:8000", "http://10.0.0.2:8000"],
        admission_timeout_sec=60,
        probe_interval_sec=5,
        retry=RetrySettings(retry_after_max_sec=10.0),
    ) as pool:
        override_timing(pool, cancel_timeout_sec=1.0)
        handle: RolloutHandle = await pool.run_rollout_async(
            initial_messages=[], chat_completions_url="", rollout_id="r1"
        )
        final: RolloutResultResponse = await handle
        cancelled: CancelRolloutsResponse = await pool.cancel_rollout("r1")
        report: dict[str, PoolServerStatus] = await pool.health()
        available: bool = report["http://10.0.0.1:8000"].available
        process_id: str | None = pool.servers()[0].process_id
        idle: dict[str, dict[str, object]] = await pool.wait_idle(
            timeout_sec=120, process_ids={"http://10.0.0.1:8000": "p"}
        )
        urls: tuple[str, ...] = pool.urls
        unavailable = RolloutServersUnavailableError(
            "x", rollout_id="r1", reasons={}, shutting_down=frozenset({"http://10.0.0.1:8000"})
        )
        reasons: dict[str, str] = unavailable.reasons
        shutting_down: frozenset[str] = unavailable.shutting_down
        lookup: LookupError = RolloutNotFoundError("x")
        del final, cancelled, available, process_id, idle, urls, reasons, shutting_down, lookup


# -- rollout_client.eval: the rollout-eval job as a library ---------------------------------
async def _eval_usage() -> None:
    import sys
    from pathlib import Path

    from rollout_client.eval import EvalOptions, EvalReport, RunControl, run_eval

    control = RunControl()
    control.request_drain("the rollout server is shutting down")
    draining: bool = control.draining
    report: EvalReport = await run_eval(
        EvalOptions(
            dataset=Path("d.jsonl"),
            server_url="http://127.0.0.1:8000",
            chat_url="http://127.0.0.1:9000/v1",
        ),
        stream=sys.stderr,
        control=control,
    )
    closing: str | None = report.closing_line
    del draining, closing


# -- rollout_server: a workflow, a grader, LocalBackend and the app factory -----------------
def _server_usage() -> None:
    from aiohttp import web

    from rollout_server import (
        AgentWorkflow,
        Grader,
        GraderContext,
        LocalBackend,
        ModelEndpointError,
        WorkflowContext,
        categorize_exception,
        create_rollout_server,
    )
    from rollout_types import RolloutErrorCategory

    class ChatFailedError(ModelEndpointError):
        """The agent's own model-endpoint error: reported as http_error for a 503."""

    status: int | None = ChatFailedError("busy", status_code=503).status_code
    category: RolloutErrorCategory = categorize_exception(ChatFailedError("busy", status_code=503))
    del status, category

    class Echo(AgentWorkflow):
        async def run(self, ctx: WorkflowContext) -> list[dict[str, object]]:
            return [*ctx.prompt, {"role": "assistant", "content": "42"}]

    class Exact(Grader):
        async def grade(self, ctx: GraderContext) -> None:
            ctx.set_reward(1.0 if ctx.label == "42" else 0.0)

    app: web.Application = create_rollout_server(
        backend=LocalBackend(workflow=Echo, grader=Exact), api_key="k", metrics=False
    )
    del app


# -- rollout_server: observability (a backend's phase times, a traced model call) ----------
def _server_observability() -> None:
    from rollout_server import ExecutionObserver, ExecutionRequest, get_rollout_context

    def report(request: ExecutionRequest) -> None:
        observer: ExecutionObserver = request.observer
        observer.observe_queue_wait(0.5)
        observer.observe_trajectory_write(0.001, failed=False)

    with get_rollout_context().model_call("m") as headers:
        traceparent: str | None = headers.get("traceparent")
    del report, traceparent


# -- protocol 1.1: turns, and the server's model gateway ------------------------------------
def _turns_usage() -> None:
    from rollout_server import LocalBackend, ModelGateway, ModelRoute, create_rollout_server
    from rollout_types import TURNS_PROTOCOL_VERSION, RolloutTurn, TurnFlag, protocol_supports

    asked = RolloutInitRequest(
        initial_messages=[],
        rollout_id="g-0",
        chat_completions_url="http://127.0.0.1:9000/v1",
        return_turns=True,
        weight_version="step-12",
        group_id="g",
    )
    turns: list[RolloutTurn] | None = structure_wire({}, RolloutResultResponse).turns
    for turn in turns or ():
        ids: list[int] | None = turn.completion_token_ids
        logprobs: list[float] | None = turn.logprobs
        usable: bool = TurnFlag.NO_COMPLETION_TOKEN_IDS not in turn.flags
        del ids, logprobs, usable
    supported: bool = protocol_supports("1.1", TURNS_PROTOCOL_VERSION)
    gateway = ModelGateway(endpoints=["http://gpu-0:8000/v1", "http://gpu-1:8000/v1"])
    route: ModelRoute = gateway.open_route(rollout_id="r", chat_completions_url="")
    base: str = route.base_url
    app = create_rollout_server(backend=LocalBackend("pkg.mod:Workflow"), model_gateway=gateway)
    del asked, supported, base, app
