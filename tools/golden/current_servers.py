"""The four recorded osmosis-ai 0.3.8 servers of one capture, and the raw-HTTP driver."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from osmosis_ai.rollout.server import create_rollout_server

from .inputs import (
    GOLDEN_LEASE_TOKEN,
    GOLDEN_SERVER_KEY,
    GOLDEN_UUID,
    POLLING_LEASE_SEC,
    PROMPT,
    RESULT_WAIT_SEC,
    RETENTION_SEC,
    chat_url,
)
from .recording import Exchange, Recorder, serve
from .user_code import make_backend
from .writer import GoldenWriter


class Driver:
    """Raw-HTTP helpers bound to one recorded server."""

    def __init__(self, http: httpx.AsyncClient, recorder: Recorder, out: GoldenWriter) -> None:
        self.http = http
        self.recorder = recorder
        self.out = out

    async def send(self, method: str, path: str, **kwargs: Any) -> Exchange:
        response = await self.http.request(method, path, **kwargs)
        await response.aread()
        return self.recorder.last(method, path)

    async def admit(self, body: dict[str, Any]) -> str:
        """POST /rollout, expect 202, register the token placeholder, return the token."""
        exchange = await self.send("POST", "/rollout", json=body)
        if exchange.status != 202:
            raise RuntimeError(f"admission failed: {exchange.status} {exchange.response_body!r}")
        token: str = json.loads(exchange.response_body)["polling_lease_token"]
        self.out.replace(token, GOLDEN_LEASE_TOKEN, "polling_lease_token")
        return token

    async def poll(self, rollout_id: str, token: str) -> Exchange:
        return await self.send(
            "GET", f"/rollout/{rollout_id}/result", headers={"X-Osmosis-Rollout-Lease": token}
        )

    async def poll_until_final(self, rollout_id: str, token: str) -> Exchange:
        for _ in range(50):
            exchange = await self.poll(rollout_id, token)
            status = json.loads(exchange.response_body)["status"]
            if status in {"success", "failure", "cancelled"}:
                return exchange
        raise RuntimeError(f"{rollout_id} never finished")

    async def health(self) -> Exchange:
        exchange = await self.send("GET", "/health")
        payload = json.loads(exchange.response_body)
        self.out.replace(payload["process_id"], GOLDEN_UUID, "process_id")
        self.out.replace(payload["instance_id"], GOLDEN_UUID, "instance_id")
        return exchange


@dataclass
class CurrentCapture:
    """The four recorded osmosis-ai 0.3.8 servers of one capture and what drives them.

    ``main`` serves a LocalBackend with the golden workflow and grader; ``nograder``
    the same without a grader; ``full`` one whose ``has_capacity()`` is False; ``auth``
    one that requires ``Bearer GOLDEN_SERVER_KEY``.
    """

    out: GoldenWriter
    main: Driver
    client: Any
    auth_client: Any
    auth_http: httpx.AsyncClient
    auth_rec: Recorder
    nograder_client: Any
    nograder_rec: Recorder
    full_http: httpx.AsyncClient
    full_rec: Recorder

    async def via_client(
        self, rollout_client: Any, recorder: Recorder, rollout_id: str, **kwargs: Any
    ) -> tuple[Exchange, Exchange]:
        """Run one rollout with the osmosis client; return (admission, final poll)."""
        kwargs.setdefault("initial_messages", PROMPT)
        kwargs.setdefault("chat_completions_url", chat_url(rollout_id))
        handle = await rollout_client.run_rollout_async(rollout_id=rollout_id, **kwargs)
        admission = recorder.last("POST", "/rollout")
        token = json.loads(admission.response_body)["polling_lease_token"]
        self.out.replace(token, GOLDEN_LEASE_TOKEN, "polling_lease_token")
        result = await handle
        final = recorder.last("GET", f"/rollout/{rollout_id}/result")
        assert json.loads(final.response_body)["status"] == result.status.value
        return admission, final


@contextlib.asynccontextmanager
async def current_servers(out: GoldenWriter, *, verbose: bool) -> AsyncIterator[CurrentCapture]:
    """Serve the four 0.3.8 servers of :class:`CurrentCapture` for the ``with`` block."""
    from osmosis_ai.rollout.client import RolloutClient

    timings = {
        "result_wait_timeout_sec": RESULT_WAIT_SEC,
        "polling_lease_timeout_sec": POLLING_LEASE_SEC,
        "result_retention_sec": RETENTION_SEC,
        "configure_logging": False,
    }
    main_app = create_rollout_server(backend=make_backend(), **timings)
    nograder_app = create_rollout_server(backend=make_backend(grader=False), **timings)
    full_app = create_rollout_server(backend=make_backend(capacity=False), **timings)
    auth_app = create_rollout_server(backend=make_backend(), api_key=GOLDEN_SERVER_KEY, **timings)

    async with (
        serve(main_app, verbose=verbose) as (main_url, main_rec),
        serve(nograder_app, verbose=verbose) as (nograder_url, nograder_rec),
        serve(full_app, verbose=verbose) as (full_url, full_rec),
        serve(auth_app, verbose=verbose) as (auth_url, auth_rec),
        httpx.AsyncClient(base_url=main_url, timeout=15) as main_http,
        httpx.AsyncClient(base_url=full_url, timeout=15) as full_http,
        httpx.AsyncClient(base_url=auth_url, timeout=15) as auth_http,
    ):
        capture = CurrentCapture(
            out=out,
            main=Driver(main_http, main_rec, out),
            client=RolloutClient(url=main_url),
            auth_client=RolloutClient(url=auth_url, api_key=GOLDEN_SERVER_KEY),
            auth_http=auth_http,
            auth_rec=auth_rec,
            nograder_client=RolloutClient(url=nograder_url),
            nograder_rec=nograder_rec,
            full_http=full_http,
            full_rec=full_rec,
        )
        yield capture
        for rollout_client in (capture.client, capture.auth_client, capture.nograder_client):
            await rollout_client.aclose()
