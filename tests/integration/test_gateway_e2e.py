"""End to end: the example agent through a rollout server's model gateway over two chat
stand-ins, as a trainer would drive it (issue 29, items 1, 2 and 5).

Eight rollouts (two groups of four, ``group_id`` set) of the calculator agent: every turn
of a rollout reaches one stand-in, a group stays on one stand-in, and the token ids and
logprobs in the results (asked for with ``return_turns``) and in each ``trajectory.json``
are exactly those the stand-ins produced. A caller that does not ask (today's client, or
an osmosis-ai 0.3.8 one) gets a result in exactly the 0.3.8 shape.

The client's side (issue 29, item 3): a group of eight through ``RolloutClient.run_group``
over the same two stand-ins, one of whose model calls fails (a stand-in outage): that
sibling is masked (or, under ``retry``, admitted again), never scored 0.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from rollout_client import RolloutClient, RolloutGroup
from rollout_server import AgentWorkflowConfig, LocalBackend, ModelGateway
from rollout_types import LEASE_HEADER

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "examples") not in sys.path:
    sys.path.insert(0, str(ROOT / "examples"))

from calculator_agent import AnswerGrader, CalculatorAgent  # noqa: E402

from .standin_loader import load_standin  # noqa: E402

GOLDEN = ROOT / "packages" / "rollout-types" / "tests" / "data" / "golden" / "osmosis-0.3.8"
QUESTIONS = [
    ("What is 17 * 23?", "391"),
    ("What is 128 + 256?", "384"),
    ("What is 15 percent of 240?", "36"),
    ("What is 1000 - 1?", "999"),
]


STANDIN = load_standin()


@pytest.fixture
async def standins() -> AsyncIterator[list[tuple[Any, str]]]:
    """Two chat stand-ins (different seeds): (app, base URL) each."""
    servers = []
    for seed in (1, 2):
        app = STANDIN.create_app(STANDIN.StandinConfig(seed=seed))
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        servers.append((server, app))
    yield [(app, str(server.make_url("/v1"))) for server, app in servers]
    for server, _ in servers:
        await server.close()


async def run_with_turns(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """Admit ``body`` and poll its result, as a protocol 1.1 caller does (raw HTTP)."""
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/rollout", json=body) as response:
            assert response.status == 202, await response.text()
            token = (await response.json())["polling_lease_token"]
        async with asyncio.timeout(60):
            while True:
                async with session.get(
                    f"{url}/rollout/{body['rollout_id']}/result", headers={LEASE_HEADER: token}
                ) as response:
                    assert response.status == 200
                    result: dict[str, Any] = await response.json()
                if result["status"] in ("success", "failure", "cancelled"):
                    return result


def backend(tmp_path: Path, *, stream: bool) -> LocalBackend:
    return LocalBackend(
        workflow=CalculatorAgent,
        workflow_config=AgentWorkflowConfig(
            name="calc", concurrency={"max_concurrent": 8}, extra={"stream": stream}
        ),
        grader=AnswerGrader,
        artifact_root=tmp_path / "artifacts",
    )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_eight_rollouts_through_the_gateway(
    serve_rollout: Any, standins: list[tuple[Any, str]], tmp_path: Path, stream: bool
) -> None:
    """Two groups of four: each rollout's turns on one stand-in, each group on one, and
    the results and trajectories carry exactly the stand-ins' token ids and logprobs."""
    gateway = ModelGateway(endpoints=[url for _, url in standins])
    server = await serve_rollout(backend(tmp_path, stream=stream), model_gateway=gateway)
    bodies = []
    for group in ("g-a", "g-b"):
        for k, (question, label) in enumerate(QUESTIONS):
            bodies.append(
                {
                    "initial_messages": [{"role": "user", "content": question}],
                    "rollout_id": f"{group}-{k}",
                    "chat_completions_url": "http://127.0.0.1:9/v1",  # the gateway's endpoints win
                    "label": label,
                    "agent_timeout_sec": 30,
                    "grader_timeout_sec": 10,
                    "return_turns": True,
                    "weight_version": "step-12",
                    "group_id": group,
                }
            )
    results = await asyncio.gather(*(run_with_turns(server.url, body) for body in bodies))

    made = [(url, produced) for app, url in standins for produced in STANDIN.produced(app)]
    groups: dict[str, set[str]] = {}
    for body, result in zip(bodies, results, strict=True):
        assert result["status"] == "success", result
        assert result["sample"]["reward"] == 1.0
        turns = result["turns"]
        assert [turn["index"] for turn in turns] == [0, 1]  # a tool call, then the answer
        endpoints = set()
        for turn in turns:
            assert turn["flags"] == []
            assert turn["weight_version"] == "step-12"
            # Exactly one stand-in produced these ids and logprobs (the seeds differ)...
            (url,) = {
                url
                for url, produced in made
                if produced["completion_token_ids"] == turn["completion_token_ids"]
                and produced["prompt_token_ids"] == turn["prompt_token_ids"]
                and produced["logprobs"] == turn["logprobs"]
            }
            assert turn["endpoint"] == url  # ...and it is the endpoint the turn names
            endpoints.add(url)
        assert len(endpoints) == 1, f"{body['rollout_id']} hit {endpoints}"
        groups.setdefault(body["group_id"], set()).update(endpoints)
        assert result["sample"]["messages"][1] == turns[0]["response_message"]

        trajectory = json.loads(
            (tmp_path / "artifacts" / body["rollout_id"] / "trajectory.json").read_text()
        )
        agent = [step for step in trajectory["steps"] if step["source"] == "agent"]
        assert [step["metrics"]["completion_token_ids"] for step in agent] == [
            turn["completion_token_ids"] for turn in turns
        ]
        assert [step["metrics"]["logprobs"] for step in agent] == [
            turn["logprobs"] for turn in turns
        ]
        assert [step["metrics"]["prompt_token_ids"] for step in agent] == [
            turn["prompt_token_ids"] for turn in turns
        ]
    assert all(len(endpoints) == 1 for endpoints in groups.values()), groups
    assert sum(len(STANDIN.produced(app)) for app, _ in standins) == 16
    assert gateway.open_routes == 0


async def test_todays_client_sees_todays_result(
    serve_rollout: Any, standins: list[tuple[Any, str]], tmp_path: Path
) -> None:
    """Through the gateway, a caller that does not opt in (our 0.2 client, osmosis-ai
    0.3.8) gets the 0.3.8 result document: its keys, in its order, and no ``turns``."""
    (app, url), _ = standins
    server = await serve_rollout(backend(tmp_path, stream=False), model_gateway=ModelGateway())
    async with RolloutClient(url=server.url, admission_timeout_sec=30) as client:
        result = await client.run_rollout(
            initial_messages=[{"role": "user", "content": "What is 17 * 23?"}],
            chat_completions_url=url,
            rollout_id=uuid.uuid4().hex,
            label="391",
        )
    assert result.status == "success"
    assert result.turns is None
    # The raw document, as an osmosis-ai client reads it.
    rid = uuid.uuid4().hex
    raw = await run_with_turns(
        server.url,
        {
            "initial_messages": [{"role": "user", "content": "What is 17 * 23?"}],
            "rollout_id": rid,
            "chat_completions_url": url,
            "label": "391",
        },
    )
    golden = json.loads((GOLDEN / "result_success.json").read_text())
    assert list(raw) == list(golden)
    assert list(raw["sample"]) == list(golden["sample"])
    assert len(STANDIN.produced(app)) == 4  # captured anyway (the trajectory has them)


class Outage:
    """A stand-in outage: the next ``calls`` chat completions, on any stand-in that has
    this middleware, answer 503."""

    def __init__(self, calls: int) -> None:
        self.left = calls
        self.failed = 0

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.endswith("/chat/completions") and self.left > 0:
            self.left -= 1
            self.failed += 1
            return web.json_response(
                {"error": {"message": "stand-in outage (test)", "type": "server_error"}},
                status=503,
            )
        response: web.StreamResponse = await handler(request)
        return response


@pytest.fixture
async def outage_standins() -> AsyncIterator[tuple[Outage, list[tuple[Any, str]]]]:
    """Two chat stand-ins (seeds 1 and 2) sharing one :class:`Outage` of one call."""
    outage = Outage(calls=1)
    servers = []
    for seed in (1, 2):
        app = STANDIN.create_app(STANDIN.StandinConfig(seed=seed))
        app.middlewares.append(outage.middleware)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        servers.append((server, app))
    yield outage, [(app, str(server.make_url("/v1"))) for server, app in servers]
    for server, _ in servers:
        await server.close()


def no_retry_backend(tmp_path: Path) -> LocalBackend:
    """The calculator agent, which does not retry a failed model call itself (so that an
    outage reaches the client) and names its model (no ``GET /models``)."""
    return LocalBackend(
        workflow=CalculatorAgent,
        workflow_config=AgentWorkflowConfig(
            name="calc",
            concurrency={"max_concurrent": 8},
            extra={"max_retries": 0, "model": "standin"},
        ),
        grader=AnswerGrader,
        artifact_root=tmp_path / "artifacts",
    )


def check_group_turns(group: RolloutGroup, standins: list[tuple[Any, str]]) -> None:
    """Each unmasked sibling's turns hit one stand-in, which produced exactly their token
    ids and logprobs; the whole group hit one stand-in; every reward is 1.0 or None."""
    made = [(url, produced) for app, url in standins for produced in STANDIN.produced(app)]
    used: set[str] = set()
    for sibling in group.unmasked:
        assert sibling.result is not None
        assert sibling.result.status == "success", sibling
        assert sibling.reward == 1.0
        assert [turn.index for turn in sibling.turns] == [0, 1]
        endpoints = set()
        for turn in sibling.turns:
            assert turn.flags == []
            assert turn.weight_version == "step-5"
            (url,) = {
                url
                for url, produced in made
                if produced["completion_token_ids"] == turn.completion_token_ids
                and produced["prompt_token_ids"] == turn.prompt_token_ids
                and produced["logprobs"] == turn.logprobs
            }
            assert turn.endpoint == url
            endpoints.add(url)
        assert len(endpoints) == 1, f"{sibling.rollout_id} hit {endpoints}"
        used |= endpoints
    assert len(used) == 1, used
    assert all(reward in (1.0, None) for reward in group.rewards), group.rewards


async def test_client_group_masks_an_outage(
    serve_rollout: Any, outage_standins: tuple[Outage, list[tuple[Any, str]]], tmp_path: Path
) -> None:
    """A group of eight through the gateway: one sibling's model call hits a stand-in
    outage and is masked (http_error, no reward); the seven others carry the stand-in's
    token ids and logprobs, each on one stand-in, the group on one."""
    outage, standins = outage_standins
    gateway = ModelGateway(endpoints=[url for _, url in standins])
    server = await serve_rollout(no_retry_backend(tmp_path), model_gateway=gateway)
    async with RolloutClient(url=server.url, admission_timeout_sec=30) as client:
        async with asyncio.timeout(120):
            group = await client.run_group(
                [{"role": "user", "content": "What is 17 * 23?"}],
                "http://127.0.0.1:9/v1",  # the gateway's endpoints win
                n=8,
                group_id="grp",
                label="391",
                agent_timeout_sec=30,
                return_turns=True,
                weight_version="step-5",
            )
    assert outage.failed == 1
    assert [sibling.rollout_id for sibling in group.rollouts] == [f"grp-{k}" for k in range(8)]
    (masked,) = [sibling for sibling in group.rollouts if sibling.masked]
    assert masked.mask_reason is not None
    assert masked.mask_reason.startswith("http_error: "), masked.mask_reason
    assert "503" in masked.mask_reason
    assert masked.reward is None
    assert len(group.unmasked) == 7
    check_group_turns(group, standins)
    assert gateway.open_routes == 0


async def test_client_group_retries_an_outage(
    serve_rollout: Any, outage_standins: tuple[Outage, list[tuple[Any, str]]], tmp_path: Path
) -> None:
    """Under ``retry`` the sibling that hit the outage is admitted again as
    ``<group>-<k>-r1`` and succeeds: eight results, all with token ids and logprobs."""
    outage, standins = outage_standins
    gateway = ModelGateway(endpoints=[url for _, url in standins])
    server = await serve_rollout(no_retry_backend(tmp_path), model_gateway=gateway)
    async with RolloutClient(url=server.url, admission_timeout_sec=30) as client:
        async with asyncio.timeout(120):
            group = await client.run_group(
                [{"role": "user", "content": "What is 17 * 23?"}],
                "http://127.0.0.1:9/v1",
                n=8,
                group_id="grr",
                policy="retry",
                label="391",
                agent_timeout_sec=30,
                return_turns=True,
                weight_version="step-5",
            )
    assert outage.failed == 1
    assert len(group.unmasked) == 8
    (retried,) = [sibling for sibling in group.rollouts if len(sibling.attempts) > 1]
    assert retried.attempts == (f"grr-{retried.index}", f"grr-{retried.index}-r1")
    assert retried.rollout_id == f"grr-{retried.index}-r1"
    check_group_turns(group, standins)
    assert group.rewards == [1.0] * 8
