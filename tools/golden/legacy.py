"""The osmosis-ai 0.3.2 capture (pre-0.3.3 HTTP + callback protocol), run by the script
under the 0.3.2 interpreter (``--legacy-mode``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from osmosis_ai.rollout import LocalBackend
from osmosis_ai.rollout.server import create_rollout_server

from .inputs import (
    CURRENT_VERSION,
    GOLDEN_CONTROLLER_KEY,
    GOLDEN_LLM_KEY,
    GOLDEN_LOOPBACK_BASE,
    LABEL,
    LEGACY_CALLER,
    LEGACY_SERVER,
    LEGACY_VERSION,
    PROMPT,
    chat_url,
)
from .recording import Recorder, serve
from .user_code import GoldenGrader, GoldenWorkflow
from .writer import GoldenWriter


@dataclass
class LegacyCapture:
    """The recorded osmosis-ai 0.3.2 server, its caller's callback app, and the caller."""

    out: GoldenWriter
    http: httpx.AsyncClient
    server_rec: Recorder
    callback_rec: Recorder
    driver: Any


async def capture_legacy(golden_root: Path, verbose: bool) -> None:
    """Capture the 0.3.2 caller's admission and callbacks, and its server's answers."""
    from osmosis_ai.rollout.controller.listener import create_callback_app
    from osmosis_ai.rollout.controller.store import CallbackStore
    from osmosis_ai.rollout.http_driver import HttpRolloutDriver
    from osmosis_ai.rollout.utils.http import close_shared_client

    out = GoldenWriter(golden_root / f"osmosis-{LEGACY_VERSION}")

    async def commit(_result: Any) -> None:
        return None

    store = CallbackStore(on_terminal_commit=commit)
    server_app = create_rollout_server(
        backend=LocalBackend(workflow=GoldenWorkflow, grader=GoldenGrader),
        configure_logging=False,
    )
    callback_app = create_callback_app(store, auth_token=GOLDEN_CONTROLLER_KEY)
    async with (
        serve(server_app, verbose=verbose) as (server_url, server_rec),
        serve(callback_app, verbose=verbose) as (callback_url, callback_rec),
        httpx.AsyncClient(base_url=server_url, timeout=15) as http,
    ):
        out.replace(callback_url, GOLDEN_LOOPBACK_BASE, "callback_listener_base_url")
        capture = LegacyCapture(
            out=out,
            http=http,
            server_rec=server_rec,
            callback_rec=callback_rec,
            driver=HttpRolloutDriver(
                rollout_base_url=server_url,
                callback_store=store,
                completion_url_for=lambda rid: f"{callback_url}/v1/rollouts/{rid}/completion",
                grader_url_for=lambda rid: f"{callback_url}/v1/rollouts/{rid}/grader",
                chat_completions_url_for=chat_url,
                chat_api_key=GOLDEN_LLM_KEY,
                controller_api_key=GOLDEN_CONTROLLER_KEY,
                callback_timeout_sec=30,
            ),
        )
        await capture_legacy_health(capture)
        await capture_callback_rollout(capture)
        await capture_legacy_status(capture)
        await capture_legacy_cancel(capture)
        await capture_pull_protocol_refusal(capture, golden_root)
        await capture.driver.aclose()
        await asyncio.sleep(0.8)  # let the cancelled-but-running workflow finish
        await close_shared_client()
    out.finish()


async def capture_legacy_health(capture: LegacyCapture) -> None:
    """``health.json`` of an idle 0.3.2 server."""
    await capture.http.get("/health")
    capture.out.response(
        "health.json",
        capture.server_rec.last("GET", "/health"),
        source=LEGACY_SERVER,
        description="0.3.2 /health on an idle server without _OSMOSIS_ROLLOUT_INSTANCE_ID.",
    )


async def capture_callback_rollout(capture: LegacyCapture) -> None:
    """One rollout of the callback protocol: the admission and both callbacks."""
    from osmosis_ai.rollout.driver import RolloutRunRequest

    out = capture.out
    outcome = await capture.driver.run(
        RolloutRunRequest(
            messages=PROMPT,
            label=LABEL,
            metadata={"topic": "arithmetic", "difficulty": 1},
            rollout_id="golden-legacy",
            agent_timeout_sec=30.0,
            grader_timeout_sec=15.0,
            extra_fields={"row_index": 3, "run_index": 0},
        )
    )
    assert outcome.sample is not None, outcome
    assert outcome.sample.reward == 0.5, outcome
    admission = capture.server_rec.last("POST", "/rollout")
    out.request(
        "init_request_callback_protocol.json",
        admission,
        source=LEGACY_CALLER,
        description="HttpRolloutDriver.run(RolloutRunRequest(...)) with label, "
        "metadata, timeouts and extra_fields; callback URLs point at a 0.3.2 "
        "CallbackListener app.",
    )
    out.response(
        "init_response_callback_protocol.json",
        admission,
        source=LEGACY_SERVER,
        description="0.3.2 admission: 202 with an empty object.",
    )
    for kind in ("completion", "grader"):
        exchange = capture.callback_rec.last("POST", f"/v1/rollouts/golden-legacy/{kind}")
        out.request(
            f"callback_{kind}_request.json",
            exchange,
            source=LEGACY_SERVER,
            description=f"The {kind} callback the 0.3.2 server pushes to the caller.",
        )
        out.response(
            f"callback_{kind}_response.json",
            exchange,
            source="osmosis-ai 0.3.2 create_callback_app",
            description=f"The caller's acknowledgment of the {kind} callback.",
        )


async def capture_legacy_status(capture: LegacyCapture) -> None:
    """``GET /rollout/{id}/status`` of the finished callback rollout."""
    await capture.http.get("/rollout/golden-legacy/status")
    capture.out.response(
        "status_response.json",
        capture.server_rec.last("GET", "/rollout/golden-legacy/status"),
        source=LEGACY_SERVER,
        description="GET /rollout/{id}/status; LocalBackend keeps no status, so unknown.",
    )


async def capture_legacy_cancel(capture: LegacyCapture) -> None:
    """The cancel request a cancelled ``driver.run`` sends itself, and the answer."""
    from osmosis_ai.rollout.driver import RolloutRunRequest

    slow = RolloutRunRequest(
        messages=PROMPT,
        label=LABEL,
        metadata={"workflow": "sleep", "seconds": 0.5},
        rollout_id="golden-legacy-cancel",
    )
    run = asyncio.create_task(capture.driver.run(slow))
    await capture.server_rec.wait_for("POST", "/rollout", "golden-legacy-cancel")
    run.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await run
    cancel = capture.server_rec.last("POST", "/rollout/cancel")
    capture.out.request(
        "cancel_request_ids.json",
        cancel,
        source=LEGACY_CALLER,
        description="Cancel sent when a driver.run task is cancelled.",
    )
    capture.out.response(
        "cancel_response.json",
        cancel,
        source=LEGACY_SERVER,
        description="0.3.2 LocalBackend does not implement cancel: empty dispositions "
        "(the workflow keeps running).",
    )


async def capture_pull_protocol_refusal(capture: LegacyCapture, golden_root: Path) -> None:
    """The 0.3.8 client's admission body (from the 0.3.8 set) refused by the 0.3.2 server."""
    pull_body = json.loads(
        (golden_root / f"osmosis-{CURRENT_VERSION}" / "init_request_full.json").read_text("utf-8")
    )
    await capture.http.post("/rollout", json=pull_body)
    capture.out.response(
        "error_422_pull_protocol_request.json",
        capture.server_rec.last("POST", "/rollout"),
        source=LEGACY_SERVER,
        description="The 0.3.8 client's body (osmosis-0.3.8/init_request_full.json) "
        "is refused: completion_callback_url is required.",
    )
