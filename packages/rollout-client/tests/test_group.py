"""Protocol 1.1 keywords and groups of sibling rollouts (issue 29, item 3), against fake
rollout servers on 127.0.0.1 whose result for each rollout id is scripted."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import web

from rollout_client import (
    GroupRollout,
    RolloutClientPool,
    RolloutGroup,
    RolloutGroupHandle,
    RolloutProtocolError,
    RolloutProtocolVersionError,
)
from rollout_client._infra import infrastructure_exception, infrastructure_result
from rollout_client.testing import override_timing
from rollout_types import PROTOCOL_VERSION_HEADER, RolloutResultResponse, structure_wire

from .conftest import EVENT_SEC, FakeServer, init_body, result_body

TURN = {
    "index": 0,
    "endpoint": "http://model/v1",
    "prompt_token_ids": [1, 2, 3],
    "completion_token_ids": [4, 5],
    "logprobs": [-0.5, -0.25],
    "flags": [],
}


def failure(rollout_id: str, category: str) -> dict[str, Any]:
    return result_body(rollout_id, "failure", err_category=category, err_message=f"{category}!")


class Script:
    """A fake rollout server: each rollout id's result body (default: a success), the
    admission statuses by id, the protocol version it advertises, and what it admitted."""

    def __init__(self, version: str | None = "1.1") -> None:
        self.version = version
        self.results: dict[str, dict[str, Any]] = {}
        self.admission_status: dict[str, int] = {}
        self.admitted: list[dict[str, Any]] = []
        self.polled: defaultdict[str, int] = defaultdict(int)

    def headers(self) -> dict[str, str]:
        return {} if self.version is None else {PROTOCOL_VERSION_HEADER: self.version}

    async def admit(self, request: web.Request) -> web.Response:
        body = await request.json()
        status = self.admission_status.get(body["rollout_id"], 202)
        if status != 202:
            return web.json_response({"detail": "no"}, status=status, headers=self.headers())
        self.admitted.append(body)
        return web.json_response(init_body(body["rollout_id"]), status=202, headers=self.headers())

    async def result(self, request: web.Request) -> web.Response:
        rollout_id = request.match_info["rid"]
        self.polled[rollout_id] += 1
        body = self.results.get(rollout_id) or result_body(rollout_id)
        return web.json_response(body, headers=self.headers())

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {"process_id": "p", "lifecycle": {"accepting_rollouts": True, "active_rollouts": 0}},
            headers=self.headers(),
        )

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/rollout", self.admit),
            web.get("/rollout/{rid}/result", self.result),
            web.get("/health", self.health),
        ]


async def start(serve: Callable[..., Any], script: Script) -> FakeServer:
    server: FakeServer = await serve(*script.routes())
    return server


MESSAGES = [{"role": "user", "content": "hi"}]


class TestProtocolKeywords:
    async def test_sent_only_when_set(self, serve, make_client):
        """Without the 1.1 keywords the body is a 1.0 body; with them it carries each one."""
        script = Script()
        server = await start(serve, script)
        client = make_client(server.url)
        await client.run_rollout(MESSAGES, "http://model/v1", "plain")
        await client.run_rollout(
            MESSAGES,
            "http://model/v1",
            "full",
            return_turns=True,
            weight_version="step-3",
            group_id="g",
        )
        plain, full = script.admitted
        assert not {"return_turns", "weight_version", "group_id"} & set(plain)
        assert (full["return_turns"], full["weight_version"], full["group_id"]) == (
            True,
            "step-3",
            "g",
        )

    async def test_turns_come_back(self, serve, make_client):
        """A 1.1 server's turns are on the result."""
        script = Script()
        script.results["t"] = result_body("t", turns=[TURN])
        server = await start(serve, script)
        result = await make_client(server.url).run_rollout(
            MESSAGES, "http://model/v1", "t", return_turns=True
        )
        assert result.turns is not None
        assert result.turns[0].completion_token_ids == [4, 5]
        assert result.turns[0].logprobs == [-0.5, -0.25]

    @pytest.mark.parametrize("version", [None, "1.0"], ids=["osmosis", "1.0"])
    async def test_return_turns_needs_1_1(self, serve, make_client, version):
        """return_turns against a server that would ignore it raises instead of answering
        no turns; without return_turns the same server is fine."""
        server = await start(serve, Script(version=version))
        client = make_client(server.url)
        with pytest.raises(RolloutProtocolVersionError, match="return_turns") as caught:
            await client.run_rollout_async(MESSAGES, "http://m/v1", "a", return_turns=True)
        assert caught.value.status_code == 202
        assert "1.1" in str(caught.value)
        result = await client.run_rollout(MESSAGES, "http://m/v1", "b")
        assert result.status == "success"

    async def test_pool_return_turns_needs_1_1(self, serve):
        """The pool's admission path checks the version as the client's does."""
        server = await start(serve, Script(version="1.0"))
        async with RolloutClientPool(urls=[server.url]) as pool:
            with pytest.raises(RolloutProtocolVersionError, match="return_turns"):
                await pool.run_rollout_async(MESSAGES, "http://m/v1", "a", return_turns=True)

    async def test_bad_values(self, serve, make_client):
        """Wrong types and empty strings are refused before any I/O."""
        client = make_client("http://127.0.0.1:9")
        with pytest.raises(TypeError, match="return_turns"):
            await client.run_rollout_async(MESSAGES, "u", "a", return_turns="yes")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="weight_version"):
            await client.run_rollout_async(MESSAGES, "u", "a", weight_version="")
        with pytest.raises(ValueError, match="group_id"):
            await client.run_rollout_async(MESSAGES, "u", "a", group_id="")


class TestInfrastructureClassification:
    def test_results(self):
        """Endpoint, lease and restart failures and unknown categories are the
        infrastructure's; the policy's own failures and successes are not."""

        def of(body: dict[str, Any]) -> str | None:
            return infrastructure_result(structure_wire(body, RolloutResultResponse))

        for category in ("http_error", "lease_expired", "internal_error", "new_kind"):
            assert of(failure("r", category)) == f"{category}: {category}!"
        for category in ("agent_error", "timeout", "validation_error", None):
            assert of(failure("r", category)) is None  # type: ignore[arg-type]
        assert of(result_body("r")) is None
        assert of(result_body("r", "cancelled")) == "cancelled"

    def test_exceptions(self):
        """Protocol errors a caller caused and version errors are raised, not masked."""
        assert infrastructure_exception(RolloutProtocolError("x", status_code=502)) is not None
        assert infrastructure_exception(RolloutProtocolError("x", status_code=409)) is None
        assert infrastructure_exception(RolloutProtocolError("x", status_code=422)) is None
        version = RolloutProtocolVersionError(
            "v", status_code=200, client_version="1.1", server_version="2.0"
        )
        assert infrastructure_exception(version) is None
        assert infrastructure_exception(ConnectionResetError("reset")).startswith("transport_error")
        assert infrastructure_exception(ValueError("bug")) is None


class TestRunGroup:
    async def test_siblings_and_ids(self, serve, make_client):
        """n siblings <group>-<k>, each sent with group_id, come back in index order."""
        script = Script()
        server = await start(serve, script)
        group = await make_client(server.url).run_group(
            MESSAGES, "http://m/v1", n=3, group_id="g7", return_turns=True, weight_version="w"
        )
        assert isinstance(group, RolloutGroup)
        assert group.group_id == "g7"
        assert [r.rollout_id for r in group.rollouts] == ["g7-0", "g7-1", "g7-2"]
        assert sorted(body["rollout_id"] for body in script.admitted) == ["g7-0", "g7-1", "g7-2"]
        assert {body["group_id"] for body in script.admitted} == {"g7"}
        assert {body["weight_version"] for body in script.admitted} == {"w"}
        assert group.rewards == [0.5, 0.5, 0.5]
        assert group.unmasked == group.rollouts

    async def test_default_group_id_is_fresh(self, serve, make_client):
        """Without group_id each group gets its own."""
        server = await start(serve, Script())
        client = make_client(server.url)
        first = await client.run_group(MESSAGES, "http://m/v1", n=1)
        second = await client.run_group(MESSAGES, "http://m/v1", n=1)
        assert first.group_id != second.group_id
        assert first.rollouts[0].rollout_id == f"{first.group_id}-0"

    async def test_mask(self, serve, make_client):
        """An infrastructure failure is masked with its reason and no reward (not 0); a
        failure that is the policy's is kept as it is."""
        script = Script()
        script.results["g-1"] = failure("g-1", "http_error")
        script.results["g-2"] = failure("g-2", "agent_error")
        server = await start(serve, script)
        group = await make_client(server.url).run_group(MESSAGES, "http://m/v1", n=3, group_id="g")
        ok, masked, scored = group.rollouts
        assert not ok.masked
        assert masked.masked
        assert masked.mask_reason == "http_error: http_error!"
        assert masked.reward is None
        assert masked.attempts == ("g-1",)
        assert masked.result is not None
        assert not scored.masked
        assert scored.result is not None
        assert scored.result.err_category == "agent_error"
        assert group.unmasked == (ok, scored)
        assert len(script.admitted) == 3  # mask never retries

    async def test_retry(self, serve, make_client):
        """A sibling that failed for the infrastructure is admitted again with a fresh id."""
        script = Script()
        script.results["g-1"] = failure("g-1", "lease_expired")
        server = await start(serve, script)
        group = await make_client(server.url).run_group(
            MESSAGES, "http://m/v1", n=2, group_id="g", policy="retry"
        )
        retried = group.rollouts[1]
        assert retried.attempts == ("g-1", "g-1-r1")
        assert retried.rollout_id == "g-1-r1"
        assert not retried.masked
        assert retried.reward == 0.5
        retry_body = next(b for b in script.admitted if b["rollout_id"] == "g-1-r1")
        assert retry_body["group_id"] == "g"

    async def test_retry_bound_then_mask(self, serve, make_client):
        """A sibling still failing after max_retries is masked, saying so."""
        script = Script()
        for rid in ("g-0", "g-0-r1", "g-0-r2"):
            script.results[rid] = failure(rid, "internal_error")
        server = await start(serve, script)
        group = await make_client(server.url).run_group(
            MESSAGES, "http://m/v1", n=1, group_id="g", policy="retry", max_retries=2
        )
        (sibling,) = group.rollouts
        assert sibling.attempts == ("g-0", "g-0-r1", "g-0-r2")
        assert sibling.masked
        assert sibling.mask_reason == "internal_error: internal_error! (after 2 retries)"
        assert "g-0-r3" not in script.polled

    async def test_admission_gateway_error_is_masked(self, serve, make_client):
        """A 502 to one sibling's admission masks that sibling (the others run)."""
        script = Script()
        script.admission_status["g-0"] = 502
        server = await start(serve, script)
        group = await make_client(server.url).run_group(MESSAGES, "http://m/v1", n=2, group_id="g")
        first, second = group.rollouts
        assert first.masked
        assert first.result is None
        assert first.mask_reason is not None
        assert first.mask_reason.startswith("admission: protocol_error: RolloutProtocolError")
        assert not second.masked

    async def test_caller_error_raises(self, serve, make_client):
        """A 409 to a sibling's admission is the caller's: run_group_async raises."""
        script = Script()
        script.admission_status["g-1"] = 409
        server = await start(serve, script)
        with pytest.raises(RolloutProtocolError) as caught:
            await make_client(server.url).run_group_async(
                MESSAGES, "http://m/v1", n=2, group_id="g"
            )
        assert caught.value.status_code == 409

    async def test_handle(self, serve, make_client):
        """The handle names the group and its current ids; await gives the group."""
        server = await start(serve, Script())
        handle = await make_client(server.url).run_group_async(
            MESSAGES, "http://m/v1", n=2, group_id="h"
        )
        assert isinstance(handle, RolloutGroupHandle)
        assert handle.group_id == "h"
        assert handle.rollout_ids == ("h-0", "h-1")
        async with asyncio.timeout(EVENT_SEC):
            group = await handle
        assert handle.done()
        assert all(isinstance(r, GroupRollout) for r in group.rollouts)

    async def test_cancel_stops_polling(self, serve, make_client):
        """cancel() stops the siblings' polling; awaiting then raises CancelledError."""
        script = Script()
        script.results["c-0"] = result_body("c-0", "running")
        server = await start(serve, script)
        client = make_client(server.url, real_time=True)
        handle = await client.run_group_async(MESSAGES, "http://m/v1", n=1, group_id="c")
        assert handle.cancel()
        with pytest.raises(asyncio.CancelledError):
            async with asyncio.timeout(EVENT_SEC):
                await handle
        polls = client._channel.polling()
        if polls:
            async with asyncio.timeout(EVENT_SEC):
                await asyncio.wait(polls)
        assert all(task.cancelled() for task in polls)
        assert script.results["c-0"]["status"] == "running"  # it never ended: polling stopped

    @pytest.mark.parametrize(
        ("kwargs", "error", "match"),
        [
            ({"group_id": "a/b"}, ValueError, "path segment"),
            ({"group_id": ""}, ValueError, "path segment"),
            ({"group_id": 3}, TypeError, "group_id"),
            ({"n": 0}, ValueError, "n must be at least 1"),
            ({"n": True}, TypeError, "n must be an int"),
            ({"max_retries": -1}, ValueError, "max_retries"),
            ({"policy": "zero"}, ValueError, "policy"),
        ],
    )
    async def test_bad_arguments(self, make_client, kwargs, error, match):
        """Bad group arguments are refused before any I/O."""
        client = make_client("http://127.0.0.1:9")
        arguments = {"n": 2, **kwargs}
        with pytest.raises(error, match=match):
            await client.run_group_async(MESSAGES, "http://m/v1", **arguments)


class TestPoolGroups:
    async def test_group_on_one_server(self, serve):
        """Every sibling of a group (and its retries) goes to one server; groups spread."""
        scripts = [Script(), Script()]
        for script in scripts:
            script.results["a-1"] = failure("a-1", "http_error")
        servers = [await start(serve, script) for script in scripts]
        async with RolloutClientPool(urls=[s.url for s in servers]) as pool:
            first = await pool.run_group(MESSAGES, "http://m/v1", n=4, group_id="a", policy="retry")
            second = await pool.run_group(MESSAGES, "http://m/v1", n=4, group_id="b")
        assert [r.attempts for r in first.rollouts][1] == ("a-1", "a-1-r1")
        by_server = [{body["group_id"] for body in script.admitted} for script in scripts]
        counts = [len(script.admitted) for script in scripts]
        assert sorted(counts) == [4, 5]
        assert all(len(groups) == 1 for groups in by_server), by_server
        assert by_server[0] != by_server[1]
        assert len(second.unmasked) == 4

    async def test_group_moves_when_its_server_fails(self, serve):
        """Once the group's server is out of rotation, the next sibling goes elsewhere."""
        good, bad = Script(), Script()
        bad.admission_status.update({"m-0": 202, "m-1": 502})
        servers = [await start(serve, bad), await start(serve, good)]
        async with RolloutClientPool(urls=[s.url for s in servers]) as pool:
            override_timing(pool, sleep=_instant)
            await pool.run_rollout(MESSAGES, "http://m/v1", "m-0", group_id="m")
            await pool.run_rollout(MESSAGES, "http://m/v1", "m-1", group_id="m")
            await pool.run_rollout(MESSAGES, "http://m/v1", "m-2", group_id="m")
        assert [b["rollout_id"] for b in bad.admitted] == ["m-0"]
        assert [b["rollout_id"] for b in good.admitted] == ["m-1", "m-2"]


async def _instant(_delay: float) -> None:
    await asyncio.sleep(0)


def test_reprs_are_plain() -> None:
    """GroupRollout and RolloutGroup are frozen values (json-able through attrs)."""
    rollout = GroupRollout(index=0, rollout_id="g-0", attempts=("g-0",), result=None)
    assert rollout.turns == []
    assert rollout.reward is None
    json.dumps({"masked": rollout.masked})
