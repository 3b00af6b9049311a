"""Contract tests of the trainer adapters (``rollout_client.trainers``, issue 29 item 4):
their answers have the fields and shapes TRL's and verl's documented contracts require,
built from token ids and logprobs the chat stand-in produced through a rollout server's
model gateway.

The contracts, as read (see ``rollout_client/trainers/_trl.py`` and ``_verl.py``):

* TRL (v1.9.0-26-gf2cd577, ``trl/trainer/grpo_trainer.py``): ``rollout_func(prompts,
  trainer) -> dict`` with ``prompt_ids``, ``completion_ids`` and ``logprobs`` (one list
  per completion, ``num_generations`` per prompt, in prompt order; a logprob per
  completion token); other keys go to the reward functions, one value per completion;
  ``env_mask`` is as long as ``completion_ids``; a reward of None leaves a completion out
  of its group's baseline.
* verl (v0.7.0-125-gb178a3c, ``verl/experimental/agent_loop/agent_loop.py``):
  ``AgentLoopOutput(prompt_ids, response_ids, response_mask, response_logprobs,
  routed_experts, multi_modal_data, reward_score, num_turns, metrics, extra_fields)``,
  ``metrics`` an ``AgentLoopMetrics(generate_sequences, tool_calls, num_preempted)``;
  ``response_mask`` is 1 for model tokens and 0 for tool tokens, as long as
  ``response_ids`` (and so are the logprobs).

With TRL or verl installed (``nox -s trainers``) the same answers also go through the
real classes.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from rollout_client import GroupRollout, RolloutClient
from rollout_client.trainers import (
    TokenSequence,
    TRLRolloutFunc,
    UntrainableRolloutError,
    agent_loop_fields,
    rollout_reward,
    token_sequence,
    trl_outputs,
    verl_agent_loop_class,
)
from rollout_server import (
    AgentWorkflow,
    AgentWorkflowConfig,
    AgentWorkflowOutput,
    LocalBackend,
    ModelGateway,
    WorkflowContext,
    get_rollout_context,
)
from rollout_types import RolloutTurn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "examples") not in sys.path:
    sys.path.insert(0, str(ROOT / "examples"))

from calculator_agent import AnswerGrader, CalculatorAgent  # noqa: E402

from .standin_loader import load_standin  # noqa: E402

TRL_KEYS = ("prompt_ids", "completion_ids", "logprobs")
VERL_OUTPUT_FIELDS = frozenset(
    {
        "prompt_ids",
        "response_ids",
        "response_mask",
        "response_logprobs",
        "routed_experts",
        "multi_modal_data",
        "reward_score",
        "num_turns",
        "metrics",
        "extra_fields",
    }
)
VERL_METRICS = frozenset({"generate_sequences", "tool_calls", "num_preempted"})
QUESTION = [{"role": "user", "content": "What is 17 * 23?"}]


STANDIN = load_standin()


class OneCall(AgentWorkflow):
    """One model call, no tools: the answer is the sample (a single-turn rollout)."""

    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        base = get_rollout_context().chat_completions_url.rstrip("/")
        body = {"model": "standin", "messages": list(ctx.prompt)}
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{base}/chat/completions", json=body) as response,
        ):
            response.raise_for_status()
            answer = await response.json()
        return AgentWorkflowOutput(messages=[*ctx.prompt, answer["choices"][0]["message"]])


@pytest.fixture
async def standin() -> AsyncIterator[tuple[Any, str]]:
    app = STANDIN.create_app(STANDIN.StandinConfig(seed=3))
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield app, str(server.make_url("/v1"))
    await server.close()


async def gateway_server(serve_rollout: Any, url: str, tmp_path: Path, workflow: Any) -> Any:
    backend = LocalBackend(
        workflow=workflow,
        workflow_config=AgentWorkflowConfig(
            name="w", concurrency={"max_concurrent": 8}, extra={"model": "standin"}
        ),
        grader=AnswerGrader,
        artifact_root=tmp_path / "artifacts",
    )
    return await serve_rollout(backend, model_gateway=ModelGateway(endpoints=[url]))


def turn(index: int, prompt: list[int], completion: list[int], **fields: Any) -> RolloutTurn:
    return RolloutTurn(
        index=index,
        endpoint="http://m/v1",
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        logprobs=[-0.5] * len(completion),
        **fields,
    )


class TestTokenSequence:
    def test_chained_turns(self) -> None:
        """Turns whose prompts extend each other make one sequence: the model's tokens
        masked 1 with their logprobs, the environment's in between 0 with logprob 0.0."""
        seq = token_sequence([turn(0, [1, 2], [3, 4]), turn(1, [1, 2, 3, 4, 9, 9], [5])])
        assert seq == TokenSequence(
            prompt_ids=[1, 2],
            completion_ids=[3, 4, 9, 9, 5],
            logprobs=[-0.5, -0.5, 0.0, 0.0, -0.5],
            mask=[1, 1, 0, 0, 1],
            num_turns=2,
        )

    def test_rerendered_history(self) -> None:
        """A prompt that does not extend the previous turn is refused, not re-tokenized."""
        with pytest.raises(UntrainableRolloutError, match="does not extend"):
            token_sequence([turn(0, [1, 2], [3]), turn(1, [1, 7, 3], [5])])

    def test_missing_tokens(self) -> None:
        """A turn without token ids names what is missing and its flags."""
        bare = RolloutTurn(index=0, endpoint="e", flags=["no_completion_token_ids"])
        with pytest.raises(UntrainableRolloutError, match="no_completion_token_ids"):
            token_sequence([bare])
        with pytest.raises(UntrainableRolloutError, match="no captured turns"):
            token_sequence([])


async def test_trl_contract(serve_rollout: Any, standin: tuple[Any, str], tmp_path: Path) -> None:
    """TRLRolloutFunc answers TRL's keys: num_generations completions per prompt, in
    prompt order, each with the stand-in's exact prompt ids, completion ids and logprobs,
    an env_mask as long as its completion and the server's reward."""
    app, url = standin
    server = await gateway_server(serve_rollout, url, tmp_path, OneCall)
    trainer = SimpleNamespace(
        num_generations=3,
        num_generations_eval=2,
        model=SimpleNamespace(training=True),
        state=SimpleNamespace(global_step=7),
        processing_class=SimpleNamespace(eos_token_id=2),
    )
    func = TRLRolloutFunc(
        url=server.url,
        chat_completions_url=url,
        label_for=lambda prompt: "391" if "17" in str(prompt) else "384",
        run_options={"agent_timeout_sec": 30},
    )
    prompts = [QUESTION, "What is 128 + 256?"]
    async with asyncio.timeout(60):
        out = await asyncio.to_thread(func, prompts, trainer)
    assert set(TRL_KEYS) <= set(out)
    total = len(prompts) * trainer.num_generations
    for key, values in out.items():
        assert isinstance(values, list), key
        assert len(values) == total, key
    produced = STANDIN.produced(app)
    assert len(produced) == total
    by_ids = {tuple(p["completion_token_ids"]): p for p in produced}
    for i in range(total):
        completion = out["completion_ids"][i]
        assert all(isinstance(t, int) for t in out["prompt_ids"][i] + completion)
        assert len(out["logprobs"][i]) == len(completion) == len(out["env_mask"][i])
        made = by_ids[tuple(completion)]
        assert out["prompt_ids"][i] == made["prompt_token_ids"]
        assert out["logprobs"][i] == made["logprobs"]
        assert out["env_mask"][i] == [1] * len(completion)
        assert out["rollout_masked"][i] is False
        assert out["rollout_id"][i].endswith(f"-{i % trainer.num_generations}")
    assert rollout_reward(out["completion_ids"], out["rollout_reward"]) == [1.0] * total
    # In eval mode the group size is num_generations_eval.
    trainer.model.training = False
    async with asyncio.timeout(60):
        evaluated = await asyncio.to_thread(func, prompts[:1], trainer)
    assert len(evaluated["completion_ids"]) == 2


def test_trl_masked_sibling_keeps_its_place() -> None:
    """A masked sibling keeps its slot (TRL needs num_generations per prompt) with no loss
    (env_mask 0) and no reward (out of the baseline), saying why."""
    from rollout_client import RolloutGroup

    masked = GroupRollout(
        index=1,
        rollout_id="g-1",
        attempts=("g-1",),
        result=None,
        masked=True,
        mask_reason="http_error: 503",
    )
    ok = _success_rollout(0, [turn(0, [1, 2], [3, 4])])
    out = trl_outputs([RolloutGroup(group_id="g", rollouts=(ok, masked))])
    assert out["completion_ids"] == [[3, 4], [3, 4]]
    assert out["env_mask"] == [[1, 1], [0, 0]]
    assert out["logprobs"][1] == [0.0, 0.0]
    assert out["rollout_reward"] == [1.0, None]
    assert out["rollout_masked"] == [False, True]
    assert out["rollout_mask_reason"][1] == "masked: http_error: 503"
    with pytest.raises(ValueError, match="fallback_eos_id"):
        trl_outputs([RolloutGroup(group_id="h", rollouts=(masked,))])
    alone = trl_outputs([RolloutGroup(group_id="h", rollouts=(masked,))], fallback_eos_id=2)
    assert alone["completion_ids"] == [[2]]
    assert alone["env_mask"] == [[0]]


def _success_rollout(index: int, turns: list[RolloutTurn]) -> GroupRollout:
    from rollout_types import RolloutResultResponse, RolloutSample

    result = RolloutResultResponse(
        rollout_id=f"g-{index}",
        status="success",
        sample=RolloutSample(messages=[], reward=1.0),
        turns=turns,
    )
    return GroupRollout(
        index=index, rollout_id=f"g-{index}", attempts=(f"g-{index}",), result=result
    )


async def test_verl_contract(serve_rollout: Any, standin: tuple[Any, str], tmp_path: Path) -> None:
    """agent_loop_fields names only AgentLoopOutput's fields (and AgentLoopMetrics'), with
    the stand-in's ids and logprobs and a response mask of 1s for a single model turn."""
    app, url = standin
    server = await gateway_server(serve_rollout, url, tmp_path, OneCall)
    async with RolloutClient(url=server.url) as client:
        group = await client.run_group(
            QUESTION, url, n=2, label="391", return_turns=True, weight_version="w1"
        )
    for rollout in group.rollouts:
        fields = agent_loop_fields(rollout, response_length=1024)
        assert set(fields) <= VERL_OUTPUT_FIELDS
        assert set(fields["metrics"]) <= VERL_METRICS
        assert any(
            fields["prompt_ids"] == made["prompt_token_ids"]
            and fields["response_ids"] == made["completion_token_ids"]
            and fields["response_logprobs"] == made["logprobs"]
            for made in STANDIN.produced(app)
        )
        assert fields["response_mask"] == [1] * len(fields["response_ids"])
        assert fields["reward_score"] == 1.0
        assert fields["num_turns"] == 2  # the user's message and the model's answer
        assert fields["extra_fields"]["rollout_masked"] is False
        cut = agent_loop_fields(rollout, response_length=2)
        assert len(cut["response_ids"]) == len(cut["response_mask"]) == 2
        assert len(cut["response_logprobs"]) == 2


async def test_multi_turn_on_the_standin_is_masked_not_retokenized(
    serve_rollout: Any, standin: tuple[Any, str], tmp_path: Path
) -> None:
    """The stand-in's toy chat template puts the tool names after the history, so the
    calculator agent's second prompt does not extend its first: the adapters keep such a
    rollout out of the loss (mask 0, reward None) and say why, rather than re-tokenize."""
    _, url = standin
    server = await gateway_server(serve_rollout, url, tmp_path, CalculatorAgent)
    async with RolloutClient(url=server.url) as client:
        group = await client.run_group(QUESTION, url, n=1, label="391", return_turns=True)
    (rollout,) = group.rollouts
    assert len(rollout.turns) == 2
    fields = agent_loop_fields(rollout, prompt_ids=[5, 6])
    assert fields["response_mask"] == [0]
    assert fields["reward_score"] is None
    assert fields["extra_fields"]["rollout_masked"] is True
    assert "does not extend" in fields["extra_fields"]["rollout_mask_reason"]


def test_verl_masked_needs_prompt_ids() -> None:
    """A rollout without a sequence needs the loop's prompt ids to keep its place."""
    masked = GroupRollout(
        index=0, rollout_id="g-0", attempts=("g-0",), result=None, masked=True, mask_reason="x"
    )
    with pytest.raises(ValueError, match="prompt_ids"):
        agent_loop_fields(masked)


def test_verl_class_imports_verl_lazily() -> None:
    """Importing the adapters does not import verl, TRL or torch; building the verl class
    does (and without verl raises ImportError)."""
    for name in ("verl", "trl", "torch"):
        if importlib.util.find_spec(name) is None:
            assert name not in sys.modules
    import inspect

    kwargs = {"rollout_url": "http://127.0.0.1:9", "chat_completions_url": "http://m/v1"}
    if importlib.util.find_spec("verl") is None:
        with pytest.raises(ImportError):
            verl_agent_loop_class(**kwargs)
        return
    with warnings.catch_warnings():
        # verl's own imports warn (Ray's state API, ...): its business, not this contract's.
        warnings.simplefilter("ignore", DeprecationWarning)
        from verl.experimental.agent_loop.agent_loop import (
            AgentLoopBase,
            AgentLoopMetrics,
            AgentLoopOutput,
        )

        built = verl_agent_loop_class(**kwargs)
    assert issubclass(built, AgentLoopBase)
    assert list(inspect.signature(built.run).parameters) == ["self", "sampling_params", "kwargs"]
    theirs = AgentLoopOutput.model_fields
    required = {name for name, field in theirs.items() if field.is_required()}
    ok = _success_rollout(0, [turn(0, [1, 2], [3, 4])])
    masked = GroupRollout(
        index=0, rollout_id="g-0", attempts=("g-0",), result=None, masked=True, mask_reason="x"
    )
    for fields in (agent_loop_fields(ok), agent_loop_fields(masked, prompt_ids=[1, 2])):
        assert required <= set(fields) <= set(theirs)
        assert set(fields["metrics"]) <= set(AgentLoopMetrics.model_fields)
        output = AgentLoopOutput(**fields)
        assert len(output.response_ids) == len(output.response_mask)
    assert AgentLoopOutput(**agent_loop_fields(ok)).response_ids == [3, 4]


def test_trl_documents_the_contract() -> None:
    """With TRL installed, its GRPOTrainer still requires exactly the keys we answer."""
    if importlib.util.find_spec("trl") is None:
        pytest.skip("trl is not installed (nox -s trainers installs it)")
    import inspect

    from trl.trainer import grpo_trainer

    source = inspect.getsource(grpo_trainer.GRPOTrainer)
    assert 'required_keys = {"prompt_ids", "completion_ids", "logprobs"}' in source
    assert "env_mask" in source


async def test_training_example_runs(tmp_path: Path) -> None:
    """examples/training/group_with_turns.py runs a group of four on the stand-ins and
    prints each sibling's reward and each turn's token ids and logprobs."""
    import io

    spec = importlib.util.spec_from_file_location(
        "group_with_turns", ROOT / "examples" / "training" / "group_with_turns.py"
    )
    assert spec is not None
    assert spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = io.StringIO()
    async with asyncio.timeout(60):
        group = await example.run(4, out, tmp_path / "artifacts")
    text = out.getvalue()
    assert len(group.unmasked) == 4
    assert text.count(": reward 1.0") == 4
    assert text.count("completion tokens [") == 8  # two model turns per sibling
    assert "weight_version step-0" in text
    for sibling in group.rollouts:
        for turn in sibling.turns:
            assert turn.completion_token_ids
            assert turn.logprobs is not None
            assert len(turn.logprobs) == len(turn.completion_token_ids)
