"""Train-ready rollouts on the chat stand-in: one GRPO group through a rollout server's
model gateway, with every sibling's token ids and logprobs.

Everything runs in this process on 127.0.0.1 (random ports): two chat stand-ins
(``tools/chat_standin``, deterministic token ids and logprobs: not a model), a rollout
server with the calculator agent and a gateway over both stand-ins (``--gateway
--model-endpoint ...`` on the command line), and a ``RolloutClient`` that runs one group
of ``--n`` siblings with ``return_turns=True``. It prints, per sibling, its reward and, per
model turn, the endpoint, the token counts and the first token ids and logprobs.

    python examples/training/group_with_turns.py --n 4

(From a checkout with the three distributions installed: see the top-level README.)
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import TextIO

from aiohttp import web

from rollout_client import RolloutClient, RolloutGroup
from rollout_server import AgentWorkflowConfig, LocalBackend, ModelGateway, create_rollout_server

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from calculator_agent import AnswerGrader, CalculatorAgent  # noqa: E402


def load_standin() -> ModuleType:
    """The chat stand-in's module (``tools/chat_standin/server.py``)."""
    name = "chat_standin_server"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, ROOT / "tools" / "chat_standin" / "server.py"
    )
    if spec is None or spec.loader is None:
        raise ImportError("tools/chat_standin/server.py is missing: run from a checkout")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


async def start(app: web.Application) -> tuple[web.AppRunner, str]:
    """Serve ``app`` on 127.0.0.1, a free port; return its runner and base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


def show(group: RolloutGroup, out: TextIO) -> None:
    """Print each sibling: reward (or why it is masked), then its turns' tokens."""
    out.write(f"group {group.group_id}: {len(group.rollouts)} siblings\n")
    for sibling in group.rollouts:
        if sibling.masked:
            out.write(f"  {sibling.rollout_id}: masked ({sibling.mask_reason})\n")
            continue
        out.write(f"  {sibling.rollout_id}: reward {sibling.reward}\n")
        for turn in sibling.turns:
            prompt = turn.prompt_token_ids or []
            completion = turn.completion_token_ids or []
            logprobs = turn.logprobs or []
            out.write(
                f"    turn {turn.index} via {turn.endpoint}: {len(prompt)} prompt tokens, "
                f"{len(completion)} completion tokens {completion[:4]}..., logprobs "
                f"{[round(value, 3) for value in logprobs[:4]]}..., "
                f"weight_version {turn.weight_version}\n"
            )


async def run(n: int, out: TextIO, artifacts: Path) -> RolloutGroup:
    """Start the stand-ins and the server, run one group of ``n``, print it, stop."""
    standin = load_standin()
    runners = []
    try:
        endpoints = []
        for seed in (1, 2):
            runner, url = await start(standin.create_app(standin.StandinConfig(seed=seed)))
            runners.append(runner)
            endpoints.append(f"{url}/v1")
        backend = LocalBackend(
            workflow=CalculatorAgent,
            workflow_config=AgentWorkflowConfig(name="calculator", extra={"model": "standin"}),
            grader=AnswerGrader,
            artifact_root=artifacts,
        )
        app = create_rollout_server(
            backend=backend, model_gateway=ModelGateway(endpoints=endpoints)
        )
        runner, server_url = await start(app)
        runners.append(runner)
        async with RolloutClient(url=server_url) as client:
            group = await client.run_group(
                [{"role": "user", "content": "What is 17 * 23?"}],
                endpoints[0],  # the gateway's --model-endpoint list wins
                n=n,
                label="391",
                agent_timeout_sec=60,
                return_turns=True,
                weight_version="step-0",
            )
        show(group, out)
        return group
    finally:
        for runner in reversed(runners):
            await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=4, help="siblings in the group (default 4)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(run(args.n, sys.stdout, Path(tmp)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
