"""The osmosis-ai 0.3.8 capture: its scenarios, in the order they run."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
from devprocs import stop_async_process
from osmosis_ai.rollout.server import create_rollout_server

from .current_cases import ERROR_CASES, TERMINAL_OUTCOMES
from .current_servers import CurrentCapture, current_servers
from .inputs import (
    CLIENT,
    CURRENT_VERSION,
    GOLDEN_LEASE_TOKEN,
    GOLDEN_LLM_KEY,
    GOLDEN_SERVER_KEY,
    GOLDEN_UUID,
    LABEL,
    LEGACY_CHILD_TIMEOUT_SEC,
    LEGACY_VERSION,
    POLLING_LEASE_SEC,
    PROMPT,
    RAW,
    REQUEST_HEADERS,
    RESULT_WAIT_SEC,
    SCRIPT_PATH,
    SERVER,
    chat_url,
    init_body,
)
from .recording import Exchange, Recorder
from .user_code import make_backend
from .writer import GoldenWriter


async def capture_current(golden_root: Path, legacy_python: str | None, verbose: bool) -> None:
    """Capture the osmosis-ai 0.3.8 set (and, via a child process, the 0.3.2 set).

    The scenarios run in this order on purpose: ``cancel_response_all.json`` lists every id
    the main server holds, and the lease-expiry rollout is admitted before the terminal
    outcomes so that its lease runs out while they are captured.
    """
    out = GoldenWriter(golden_root / f"osmosis-{CURRENT_VERSION}")
    async with current_servers(out, verbose=verbose) as capture:
        await capture_health_idle(capture)
        await capture_minimal_rollout(capture)
        await capture_full_rollout(capture)
        await capture_running_and_cancelled(capture)
        await capture_cancel_by_prefix(capture)
        await capture_cancel_all(capture)
        lease_expiry = asyncio.create_task(poll_after_lease_expiry(capture))
        await asyncio.sleep(0.2)  # let it admit before the next ids are registered
        await capture_terminal_outcomes(capture)
        await capture_error_bodies(capture)
        await capture_auth_refusals(capture)
        await capture_capacity_refusal(capture)
        await capture_shutdown_503(out)
        out.response(
            "result_lease_expired.json",
            await lease_expiry,
            source=SERVER,
            description=f"No poll for polling_lease_timeout_sec={POLLING_LEASE_SEC}: "
            "failure/lease_expired, then a late poll.",
        )
        if legacy_python:
            await run_legacy_child(legacy_python, golden_root, verbose)
            await capture_callback_protocol_admission(capture, golden_root)
        await check_duplicate_refused(capture)
    out.finish()


async def capture_health_idle(capture: CurrentCapture) -> None:
    """``health.json``: an idle server."""
    capture.out.response(
        "health.json",
        await capture.main.health(),
        source=RAW,
        description="GET /health on an idle LocalBackend server (default max_concurrent 4).",
    )


async def capture_minimal_rollout(capture: CurrentCapture) -> None:
    """The admission body of the osmosis client with every default, and what follows it."""
    out = capture.out
    admission, final = await capture.via_client(
        capture.client, capture.main.recorder, "golden-minimal"
    )
    out.request(
        "init_request_minimal.json",
        admission,
        source=CLIENT,
        description="client.run_rollout(initial_messages, chat_completions_url, "
        "rollout_id) with every optional argument left at its default.",
    )
    out.response(
        "init_response.json",
        admission,
        source=SERVER,
        description="202 admission response (server built with "
        f"result_wait_timeout_sec={RESULT_WAIT_SEC}, "
        f"polling_lease_timeout_sec={POLLING_LEASE_SEC}).",
    )
    poll_headers = {
        h: final.request_headers[h] for h in REQUEST_HEADERS if h in final.request_headers
    }
    out.request(
        "result_poll_request_headers.json",
        final,
        body={"method": final.method, "path": final.path, "headers": poll_headers},
        source=CLIENT,
        description="The long-poll GET carries no body; this file lists the headers "
        "the osmosis client sends on it.",
    )
    out.response(
        "result_failure_no_label_no_metadata.json",
        final,
        source=SERVER,
        description="Grader configured but label and metadata both null: the grading "
        "gate fails and the wire result is an all-null failure.",
    )


async def capture_full_rollout(capture: CurrentCapture) -> None:
    """The admission body with every optional argument set, and its successful result."""
    admission, final = await capture.via_client(
        capture.auth_client,
        capture.auth_rec,
        "golden-full",
        label=LABEL,
        metadata={"topic": "arithmetic", "difficulty": 1},
        llm_api_key=GOLDEN_LLM_KEY,
        grade=True,
        agent_timeout_sec=30.0,
        grader_timeout_sec=15.0,
        extra_fields={"row_index": 3, "run_index": 0},
    )
    capture.out.request(
        "init_request_full.json",
        admission,
        source=f"{CLIENT} (built with api_key, sent to an auth-enabled server)",
        description="client.run_rollout with label, metadata, llm_api_key, both "
        "timeouts, grade=True and extra_fields set.",
    )
    capture.out.response(
        "result_success.json",
        final,
        source=SERVER,
        description="Final poll of golden-full: workflow returned messages and "
        "metrics, grader set reward 0.5.",
    )


async def capture_running_and_cancelled(capture: CurrentCapture) -> None:
    """A running rollout's poll, busy health, the client's cancel, and the cancelled result."""
    out, main = capture.out, capture.main
    token = await main.admit(
        init_body("golden-running", metadata={"workflow": "sleep", "seconds": 30})
    )
    out.response(
        "result_running.json",
        await main.poll("golden-running", token),
        source=SERVER,
        description="Poll of a sleeping workflow; returns after at most "
        "result_wait_timeout_sec with status running and everything else null.",
    )
    out.response(
        "health_busy.json",
        await main.health(),
        source=RAW,
        description="GET /health while exactly one rollout is executing.",
    )
    await capture.client.cancel_rollout("golden-running")
    cancel = main.recorder.last("POST", "/rollout/cancel")
    out.request(
        "cancel_request_ids.json",
        cancel,
        source=CLIENT,
        description="client.cancel_rollout(rollout_id): the ids selector with "
        "explicit null/false for the other selectors.",
    )
    out.response(
        "cancel_response.json",
        cancel,
        source=SERVER,
        description="Dispositions after cancelling one running rollout.",
    )
    out.response(
        "result_cancelled.json",
        await main.poll_until_final("golden-running", token),
        source=SERVER,
        description="Final poll after cancelling a running rollout (LocalBackend: "
        "the server cancels its own task).",
    )
    out.response(
        "cancel_response_not_found.json",
        await main.send("POST", "/rollout/cancel", json={"ids": ["golden-running"]}),
        source=SERVER,
        description="Repeating the cancel after the result was published.",
        include_request=True,
    )


async def capture_cancel_by_prefix(capture: CurrentCapture) -> None:
    """A prefix cancel over one finished and one running rollout."""
    main = capture.main
    done_token = await main.admit(init_body("golden-cancel-done"))
    await main.poll_until_final("golden-cancel-done", done_token)
    await cancel_running(
        capture,
        "golden-cancel-sleep",
        {"prefix": "golden-cancel-"},
        name="prefix",
        request_description="Prefix selector with the other selectors omitted.",
        response_description="Prefix cancel over one finished (not_found) and one running "
        "(cancelled_running) rollout.",
    )


async def capture_cancel_all(capture: CurrentCapture) -> None:
    """``all=true``: every id the server holds, in registration order."""
    await cancel_running(
        capture,
        "golden-cancel-all",
        {"all": True},
        name="all",
        request_description="All selector with the other selectors omitted.",
        response_description="all=true lists every id the server holds, finished ones as "
        "not_found, in registration order.",
    )


async def cancel_running(
    capture: CurrentCapture,
    rollout_id: str,
    selector: dict[str, Any],
    *,
    name: str,
    request_description: str,
    response_description: str,
) -> None:
    """Cancel a running rollout with a hand-written ``selector`` (the other keys omitted).

    Admits ``rollout_id`` as a sleeping rollout, waits until it runs, sends the cancel,
    writes ``cancel_request_{name}.json`` and ``cancel_response_{name}.json``, then waits
    for the rollout's final result.
    """
    out, main = capture.out, capture.main
    token = await main.admit(init_body(rollout_id, metadata={"workflow": "sleep", "seconds": 30}))
    await main.poll(rollout_id, token)  # wait until it is running
    exchange = await main.send("POST", "/rollout/cancel", json=selector)
    out.request(
        f"cancel_request_{name}.json",
        exchange,
        source="hand-written (keys omitted on purpose); accepted with 200",
        description=request_description,
    )
    out.response(
        f"cancel_response_{name}.json",
        exchange,
        source=SERVER,
        description=response_description,
    )
    await main.poll_until_final(rollout_id, token)


async def poll_after_lease_expiry(capture: CurrentCapture) -> Exchange:
    """Admit a sleeping rollout, never poll it until its lease expired, then poll once."""
    main = capture.main
    lease_token = await main.admit(
        init_body("golden-lease-expired", metadata={"workflow": "sleep", "seconds": 30})
    )
    await asyncio.sleep(POLLING_LEASE_SEC + 0.5)
    return await main.poll("golden-lease-expired", lease_token)


async def capture_terminal_outcomes(capture: CurrentCapture) -> None:
    """Each of :data:`TERMINAL_OUTCOMES` through the osmosis client, then a grader-less one."""
    for name, rollout_id, arguments, description in TERMINAL_OUTCOMES:
        _, final = await capture.via_client(
            capture.client, capture.main.recorder, rollout_id, **{"label": LABEL, **arguments}
        )
        capture.out.response(name, final, source=SERVER, description=description)
    _, final = await capture.via_client(
        capture.nograder_client, capture.nograder_rec, "golden-no-grader", label=LABEL
    )
    capture.out.response(
        "result_failure_no_grader.json",
        final,
        source=f"{SERVER}, LocalBackend without a grader",
        description="No grader configured, grade=true: all-null failure.",
    )


async def capture_error_bodies(capture: CurrentCapture) -> None:
    """Each of :data:`ERROR_CASES`, sent raw to the main server."""
    for name, method, path, arguments, description in ERROR_CASES:
        exchange = await capture.main.send(method, path, **arguments)
        capture.out.response(
            name, exchange, source=RAW, description=description, include_request=True
        )


async def capture_auth_refusals(capture: CurrentCapture) -> None:
    """401 without a key, and 401 (not 404) on an unknown path with a lower-case scheme."""
    await capture.auth_http.post("/rollout", json=init_body("golden-unauthorized"))
    capture.out.response(
        "error_401.json",
        capture.auth_rec.last("POST", "/rollout"),
        source=f"{RAW}; server built with api_key",
        description="No Authorization header on an auth-enabled server.",
        include_request=True,
    )
    await capture.auth_http.get(
        "/nothing", headers={"Authorization": f"bearer {GOLDEN_SERVER_KEY}"}
    )
    capture.out.response(
        "error_401_unknown_route.json",
        capture.auth_rec.last("GET", "/nothing"),
        source=f"{RAW}; server built with api_key",
        description="Lower-case 'bearer' scheme on an unknown path: auth runs before "
        "routing, so 401 rather than 404.",
    )


async def capture_capacity_refusal(capture: CurrentCapture) -> None:
    """429 with Retry-After from a backend without capacity."""
    await capture.full_http.post("/rollout", json=init_body("golden-full-queue"))
    capture.out.response(
        "error_429.json",
        capture.full_rec.last("POST", "/rollout"),
        source=f"{RAW}; backend.has_capacity() returns False",
        description="Capacity refusal with Retry-After.",
        include_request=True,
    )


async def capture_callback_protocol_admission(capture: CurrentCapture, golden_root: Path) -> None:
    """The 0.3.2 caller's body (captured by the legacy run) admitted by the 0.3.8 server."""
    out, main = capture.out, capture.main
    legacy_dir = golden_root / f"osmosis-{LEGACY_VERSION}"
    legacy_body = json.loads(
        (legacy_dir / "init_request_callback_protocol.json").read_text("utf-8")
    )
    exchange = await main.send("POST", "/rollout", json=legacy_body)
    token = json.loads(exchange.response_body)["polling_lease_token"]
    out.replace(token, GOLDEN_LEASE_TOKEN, "polling_lease_token")
    out.response(
        "init_response_to_callback_protocol_request.json",
        exchange,
        source=SERVER,
        description="The 0.3.2 HttpRolloutDriver body (from "
        f"osmosis-{LEGACY_VERSION}/init_request_callback_protocol.json) is admitted: "
        "the callback keys are ignored, and no callback will ever be sent.",
    )
    await main.poll_until_final(legacy_body["rollout_id"], token)


async def check_duplicate_refused(capture: CurrentCapture) -> None:
    """Confirm the 0.3.8 client turns a 409 into ``RolloutProtocolError(409)`` (no file).

    The osmosis client against a 0.3.2-style refusal is covered by the legacy set.
    """
    from osmosis_ai.rollout.client import RolloutProtocolError

    refused: RolloutProtocolError | None = None
    try:
        await capture.client.run_rollout_async(
            initial_messages=PROMPT,
            chat_completions_url=chat_url("golden-minimal"),
            rollout_id="golden-minimal",
        )
    except RolloutProtocolError as exc:
        refused = exc
    if refused is None or refused.status_code != 409:
        raise AssertionError(f"duplicate admission was not refused with 409: {refused!r}")


async def capture_shutdown_503(out: GoldenWriter) -> None:
    """Reach the shutdown-time 503 by running the app's lifespan by hand.

    uvicorn stops listening before lifespan shutdown, so over a socket a caller sees
    connection errors instead. The ASGI transport keeps the app reachable while its
    lifespan drains one in-flight rollout.
    """
    app = create_rollout_server(
        backend=make_backend(),
        result_wait_timeout_sec=RESULT_WAIT_SEC,
        polling_lease_timeout_sec=POLLING_LEASE_SEC,
        configure_logging=False,
    )
    recorder = Recorder(app)
    lifespan = app.router.lifespan_context(app)
    await lifespan.__aenter__()
    transport = httpx.ASGITransport(app=recorder)
    async with httpx.AsyncClient(transport=transport, base_url="http://asgi.invalid") as http:
        slow = init_body("golden-draining", metadata={"workflow": "sleep", "seconds": 0.8})
        admitted = await http.post("/rollout", json=slow)
        token = admitted.json()["polling_lease_token"]
        out.replace(token, GOLDEN_LEASE_TOKEN, "polling_lease_token")
        shutdown = asyncio.create_task(lifespan.__aexit__(None, None, None))
        await asyncio.sleep(0.1)
        await http.post("/rollout", json=init_body("golden-after-shutdown"))
        out.response(
            "error_503.json",
            recorder.last("POST", "/rollout"),
            source=f"{SERVER}, driven through httpx.ASGITransport during lifespan shutdown",
            description="Admission after shutdown began (no Retry-After).",
            include_request=True,
        )
        health = await http.get("/health")
        payload = health.json()
        out.replace(payload["process_id"], GOLDEN_UUID, "process_id")
        out.response(
            "health_shutting_down.json",
            recorder.last("GET", "/health"),
            source=f"{SERVER}, driven through httpx.ASGITransport during lifespan shutdown",
            description="GET /health while the lifespan drains one in-flight rollout.",
        )
        await shutdown


async def run_legacy_child(python: str, golden_root: Path, verbose: bool) -> None:
    """Re-run this file under the osmosis-ai 0.3.2 interpreter, and wait for it."""
    argv = [python, str(SCRIPT_PATH), "--legacy-mode", "--out", str(golden_root)]
    if verbose:
        argv.append("--verbose")
    process = await asyncio.create_subprocess_exec(*argv)
    code, killed = await stop_async_process(process, patience_sec=LEGACY_CHILD_TIMEOUT_SEC)
    if killed:
        raise TimeoutError(
            f"legacy capture (pid {process.pid}) did not finish within "
            f"{LEGACY_CHILD_TIMEOUT_SEC:g} s and was killed"
        )
    if code != 0:
        raise RuntimeError(f"legacy capture (pid {process.pid}) exited with {code}")
