"""trajectory.json as ATIF: the conversion of chat messages into steps, the document, and the
files LocalBackend writes, each checked against the ATIF models of the ``atif`` package."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import atif
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_server import (
    AgentWorkflow,
    AgentWorkflowOutput,
    ExecutionRequest,
    ExecutionResult,
    Grader,
    GraderContext,
    LocalBackend,
    Sample,
    WorkflowContext,
)
from rollout_server.execution._atif import ATIF_SCHEMA_VERSION, build_trajectory, conversation_steps
from rollout_server.execution._trajectory import encode_document
from rollout_types import RolloutErrorCategory, RolloutStatus

WAIT_SEC = 5.0
ATIF_V17_PART_TYPES = frozenset({"text", "image"})
"""Content part types ATIF-v1.7 has (``audio`` came with v1.8, which the models accept)."""


def check_atif(document: dict[str, Any]) -> atif.Trajectory:
    """Validate ``document``, encoded as the server writes it, as strict ATIF-v1.7 (JSON
    types exactly, nothing unknown)."""
    decoded = json.loads(encode_document(document, "trajectory"))
    trajectory = atif.Trajectory.model_validate(decoded, strict=True)
    assert trajectory.schema_version == ATIF_SCHEMA_VERSION == "ATIF-v1.7"
    assert trajectory.steps, "ATIF needs at least one step"
    for step in trajectory.steps:
        contents: list[Any] = [step.message]
        if step.observation is not None:
            contents += [result.content for result in step.observation.results]
        for content in contents:
            if isinstance(content, list):
                assert {part.type for part in content} <= ATIF_V17_PART_TYPES
    return trajectory


def document_of(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """A minimal ATIF document around ``steps``."""
    return {
        "schema_version": ATIF_SCHEMA_VERSION,
        "agent": {"name": "test", "version": "0"},
        "steps": steps,
    }


def call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    """A chat-completions tool call."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


TOOL_CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": "What is 6*7, and the weather?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            call("c1", "calculator", '{"expression": "6*7"}'),
            call("c2", "weather", {"city": "Oslo"}),
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "42"},
    {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "rain"}]},
    {"role": "assistant", "content": "42, and rain."},
]

MULTIPART_CONVERSATION: list[dict[str, Any]] = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is in these pictures?"},
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.PNG"}},
            {"type": "image_url", "image_url": "https://example.com/photos/dog.jpeg?size=2"},
        ],
    },
    {
        "role": "assistant",
        "content": [{"type": "text", "text": "A cat"}, {"type": "text", "text": "and a dog."}],
    },
]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=6,
)
contents = (
    st.none()
    | st.text(max_size=5)
    | st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"])})
        | st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=5) | st.none()})
        | st.fixed_dictionaries(
            {
                "type": st.just("image_url"),
                "image_url": st.sampled_from(["http://e.com/a.png", "data:image/png;base64,"])
                | st.fixed_dictionaries({"url": st.text(max_size=8)}),
            }
        )
        | json_values,
        max_size=3,
    )
    | json_values
)
tool_calls = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "id": st.sampled_from(["a", "b", ""]) | json_values,
            "type": st.just("function") | json_values,
            "function": st.fixed_dictionaries(
                {},
                optional={
                    "name": st.text(max_size=4) | json_values,
                    "arguments": st.sampled_from(['{"x": 1}', "[]", "{", ""]) | json_values,
                },
            )
            | json_values,
        },
    ),
    max_size=3,
)
chat_messages = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "function"])
        | json_values,
        "content": contents,
        "tool_calls": tool_calls | json_values,
        "tool_call_id": st.sampled_from(["a", "b"]) | json_values,
        "reasoning_content": st.text(max_size=5) | json_values,
        "name": st.text(max_size=5),
    },
)


def request_for(rollout_id: str = "r1", **fields: Any) -> ExecutionRequest:
    return ExecutionRequest(
        id=rollout_id,
        prompt=[{"role": "user", "content": "hi"}],
        chat_completions_url="http://127.0.0.1:9/v1",
        **fields,
    )


class TestConversationSteps:
    def test_roles(self) -> None:
        """system and developer become system steps, user user, assistant agent; any other
        role is a user step that keeps its role in extra."""
        steps = conversation_steps(
            [
                {"role": "system", "content": "s"},
                {"role": "developer", "content": "d"},
                {"role": "user", "content": "u", "name": "ann"},
                {"role": "assistant", "content": "a"},
                {"role": "environment", "content": "e"},
                {"content": "no role"},
            ]
        )
        check_atif(document_of(steps))
        assert steps == [
            {"step_id": 1, "source": "system", "message": "s"},
            {"step_id": 2, "source": "system", "message": "d"},
            {"step_id": 3, "source": "user", "message": "u", "extra": {"name": "ann"}},
            {"step_id": 4, "source": "agent", "message": "a"},
            {"step_id": 5, "source": "user", "message": "e", "extra": {"role": "environment"}},
            {"step_id": 6, "source": "user", "message": "no role"},
        ]

    def test_tool_calls_and_results(self) -> None:
        """An assistant's tool calls become the agent step's tool calls (arguments parsed),
        and the tool messages after it its observation results, each tied to its call."""
        steps = conversation_steps(TOOL_CONVERSATION)
        check_atif(document_of(steps))
        assert [step["source"] for step in steps] == ["system", "user", "agent", "agent"]
        acting = steps[2]
        assert acting["message"] == ""
        assert acting["tool_calls"] == [
            {
                "tool_call_id": "c1",
                "function_name": "calculator",
                "arguments": {"expression": "6*7"},
            },
            {"tool_call_id": "c2", "function_name": "weather", "arguments": {"city": "Oslo"}},
        ]
        assert acting["observation"] == {
            "results": [
                {"source_call_id": "c1", "content": "42"},
                {"source_call_id": "c2", "content": [{"type": "text", "text": "rain"}]},
            ]
        }
        assert "extra" not in acting
        assert steps[3] == {"step_id": 4, "source": "agent", "message": "42, and rain."}

    def test_results_that_match_no_call(self) -> None:
        """A tool result before any agent step gets a system step of its own; one whose id
        the agent step did not call keeps the id in extra."""
        steps = conversation_steps(
            [
                {"role": "tool", "tool_call_id": "early", "content": "x"},
                {"role": "assistant", "content": "", "tool_calls": [call("c1", "f", "{}")]},
                {"role": "tool", "tool_call_id": "other", "content": "y"},
                {"role": "function", "name": "f", "content": "z"},
            ]
        )
        check_atif(document_of(steps))
        assert steps[0] == {
            "step_id": 1,
            "source": "system",
            "message": "",
            "observation": {
                "results": [{"content": "x", "extra": {"role": "tool", "tool_call_id": "early"}}]
            },
        }
        assert steps[1]["observation"]["results"] == [
            {"content": "y", "extra": {"tool_call_id": "other"}},
            {"content": "z", "extra": {"role": "function", "name": "f"}},
        ]

    def test_malformed_tool_calls_are_kept(self) -> None:
        """Arguments that are not a JSON object give {} and stay in the call's extra; a call
        without an id gets one; a tool_calls value that is not a list of objects stays in
        the step's extra."""
        steps = conversation_steps(
            [
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        call("c1", "f", "not json"),
                        call("c2", "g", "[1, 2]"),
                        {"type": "function", "function": {"name": "h", "arguments": ""}},
                        {"id": 7, "type": "custom", "custom": {"name": "k", "input": "x"}},
                    ],
                },
                {"role": "assistant", "content": "", "tool_calls": "oops"},
            ]
        )
        check_atif(document_of(steps))
        assert steps[0]["tool_calls"] == [
            {
                "tool_call_id": "c1",
                "function_name": "f",
                "arguments": {},
                "extra": {"function": {"arguments": "not json"}},
            },
            {
                "tool_call_id": "c2",
                "function_name": "g",
                "arguments": {},
                "extra": {"function": {"arguments": "[1, 2]"}},
            },
            {"tool_call_id": "step1-call3", "function_name": "h", "arguments": {}},
            {
                "tool_call_id": "step1-call4",
                "function_name": "",
                "arguments": {},
                "extra": {"id": 7, "type": "custom", "custom": {"name": "k", "input": "x"}},
            },
        ]
        assert steps[1] == {
            "step_id": 2,
            "source": "agent",
            "message": "",
            "extra": {"tool_calls": "oops"},
        }

    def test_agent_only_fields_stay_in_extra_elsewhere(self) -> None:
        """reasoning_content is the agent step's; on a user message it (and tool_calls) stay
        in extra, since ATIF allows them on agent steps only."""
        steps = conversation_steps(
            [
                {"role": "user", "content": "q", "reasoning_content": "r", "tool_calls": []},
                {"role": "assistant", "content": "a", "reasoning_content": "thought"},
                {"role": "assistant", "content": "b", "reasoning_content": {"k": 1}},
            ]
        )
        check_atif(document_of(steps))
        assert steps[0]["extra"] == {"reasoning_content": "r", "tool_calls": []}
        assert steps[1]["reasoning_content"] == "thought"
        assert steps[2]["extra"] == {"reasoning_content": {"k": 1}}

    def test_multipart_content(self) -> None:
        """Text parts and image URLs of a known type become ATIF content parts; the
        message is then a list of parts."""
        steps = conversation_steps(MULTIPART_CONVERSATION)
        check_atif(document_of(steps))
        assert steps[0]["message"] == [
            {"type": "text", "text": "What is in these pictures?"},
            {
                "type": "image",
                "source": {"media_type": "image/png", "path": "https://example.com/cat.PNG"},
            },
            {
                "type": "image",
                "source": {
                    "media_type": "image/jpeg",
                    "path": "https://example.com/photos/dog.jpeg?size=2",
                },
            },
        ]
        assert "extra" not in steps[0]
        assert steps[1]["message"] == [
            {"type": "text", "text": "A cat"},
            {"type": "text", "text": "and a dog."},
        ]

    def test_parts_that_do_not_convert_keep_the_original(self) -> None:
        """When a part has no exact ATIF form (a data: URL, an unknown image type, a path
        that is no http(s) URL, audio, extra keys), the message has the parts that convert
        and extra the whole list."""
        content = [
            {"type": "text", "text": "look", "cache_control": {"type": "ephemeral"}},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "image_url", "image_url": {"url": "https://example.com/x.bmp"}},
            {"type": "image_url", "image_url": {"url": "pictures/local.png"}},
            {"type": "image_url", "image_url": {"url": "https://e.com/a.gif", "detail": "low"}},
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
            "stray",
        ]
        steps = conversation_steps([{"role": "user", "content": content}])
        check_atif(document_of(steps))
        assert steps[0]["message"] == [
            {"type": "text", "text": "look"},
            {"type": "image", "source": {"media_type": "image/gif", "path": "https://e.com/a.gif"}},
        ]
        assert steps[0]["extra"] == {"content": content}

    def test_content_that_is_not_text_or_parts(self) -> None:
        """Null content is an empty message; any other value stays in extra; an item that
        is not an object is a user step holding it."""
        steps = conversation_steps(
            [
                {"role": "assistant", "content": None},
                {"role": "user", "content": {"odd": True}},
                {"role": "user", "content": []},
                "just text",
            ]
        )
        check_atif(document_of(steps))
        assert [step["message"] for step in steps] == ["", "", "", ""]
        assert "extra" not in steps[0]
        assert steps[1]["extra"] == {"content": {"odd": True}}
        assert "extra" not in steps[2]
        assert steps[3]["extra"] == {"message": "just text"}

    @settings(deadline=None)  # no per-example time limit: the machine may be loaded
    @given(messages=st.lists(chat_messages | json_values, min_size=1, max_size=6))
    def test_any_messages_give_valid_atif(self, messages: list[Any]) -> None:
        """Whatever the messages hold, the steps are valid ATIF, one at least."""
        check_atif(document_of(conversation_steps(messages)))

    def test_messages_are_not_changed(self) -> None:
        """Converting leaves the messages as they were."""
        before = json.dumps(TOOL_CONVERSATION + MULTIPART_CONVERSATION)
        conversation_steps(TOOL_CONVERSATION + MULTIPART_CONVERSATION)
        assert json.dumps(TOOL_CONVERSATION + MULTIPART_CONVERSATION) == before


class TestBuildTrajectory:
    def build(self, sample: Sample | None, **request_fields: Any) -> dict[str, Any] | None:
        reported = ExecutionResult(status=RolloutStatus.SUCCESS, sample=sample)
        return build_trajectory(
            request=request_for(**request_fields),
            reported=reported,
            sample=sample,
            workflow=reported,
            grader=None,
            timings={"queued_sec": 0.0, "workflow_sec": 0.1, "grader_sec": None, "total_sec": 0.1},
        )

    @pytest.mark.parametrize("messages", [None, []])
    def test_no_conversation_no_document(self, messages: list[dict[str, Any]] | None) -> None:
        """Without a sample, or with no trajectory messages, there is no document."""
        assert self.build(None) is None
        assert (
            self.build(
                Sample(messages=[{"role": "user", "content": "x"}], trajectory_messages=messages)
            )
            is None
        )

    def test_identity_and_osmosis_extra(self) -> None:
        """The rollout id is the session and trajectory id and extra.osmosis.rollout_id;
        the request's label stands in for a sample without one; nulls and empty sample
        fields are left out."""
        sample = Sample(trajectory_messages=[{"role": "user", "content": "x"}])
        document = self.build(sample, label="L", request_extra_fields={"row_index": 3})
        assert document is not None
        check_atif(document)
        assert (document["session_id"], document["trajectory_id"]) == ("r1", "r1")
        assert document["extra"]["osmosis"] == {
            "rollout_id": "r1",
            "label": "L",
            "request_extra_fields": {"row_index": 3},
        }
        full = Sample(
            trajectory_messages=[{"role": "user", "content": "x"}],
            label="own",
            reward=0.0,
            metrics={"m": 1},
            extra_fields={"e": 2},
        )
        document = self.build(full, label="L", metadata={})
        assert document is not None
        assert document["extra"]["osmosis"] == {
            "rollout_id": "r1",
            "label": "own",
            "reward": 0.0,
            "sample_metrics": {"m": 1},
            "sample_extra_fields": {"e": 2},
            "request_metadata": {},
        }


# -- the files LocalBackend writes --------------------------------------------------------


class ToolWorkflow(AgentWorkflow):
    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        return AgentWorkflowOutput(messages=[*TOOL_CONVERSATION], metrics={"turns": 2})


class MultipartWorkflow(AgentWorkflow):
    async def run(self, ctx: WorkflowContext) -> list[dict[str, Any]]:
        return [*MULTIPART_CONVERSATION]


class FullGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        ctx.set_reward(1.0)


class RaisingGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        ctx.set_reward(0.3)
        raise ValueError("grader: bad answer format")


def saved(root: Path, rollout_id: str = "r1") -> tuple[dict[str, Any], atif.Trajectory]:
    """The rollout's trajectory.json as written, and its ATIF model."""
    document: dict[str, Any] = json.loads((root / rollout_id / "trajectory.json").read_bytes())
    return document, check_atif(document)


class TestSavedDocuments:
    async def test_tool_calls(self, tmp_path: Path) -> None:
        """A graded conversation with tool calls is saved as valid ATIF with its reward."""
        backend = LocalBackend(ToolWorkflow, grader=FullGrader, artifact_root=tmp_path)
        await backend.execute(request_for(label="42", request_extra_fields={"row_index": 0}))
        document, trajectory = saved(tmp_path)
        assert document["steps"] == conversation_steps(TOOL_CONVERSATION)
        assert trajectory.steps[2].tool_calls is not None
        assert document["extra"]["osmosis"] == {
            "rollout_id": "r1",
            "label": "42",
            "reward": 1.0,
            "sample_metrics": {"turns": 2},
            "request_extra_fields": {"row_index": 0},
        }
        assert document["extra"]["rollout_server"]["status"] == "success"

    async def test_multipart_content(self, tmp_path: Path) -> None:
        """A conversation with multi-part content is saved as valid ATIF content parts."""
        backend = LocalBackend(MultipartWorkflow, artifact_root=tmp_path)
        await backend.execute(request_for(grade=False))
        document, trajectory = saved(tmp_path)
        assert isinstance(trajectory.steps[0].message, list)
        assert document["steps"] == conversation_steps(MULTIPART_CONVERSATION)

    async def test_failure(self, tmp_path: Path) -> None:
        """A grader failure saves valid ATIF with the error and the reward it had set, and
        the traceback in diagnostics.json."""
        backend = LocalBackend(ToolWorkflow, grader=RaisingGrader, artifact_root=tmp_path)
        outcome = await backend.execute(request_for(label="42"))
        assert outcome.reported().err_category == RolloutErrorCategory.VALIDATION_ERROR
        document, _ = saved(tmp_path)
        record = document["extra"]["rollout_server"]
        assert (record["status"], record["err_message"], record["err_category"]) == (
            "failure",
            "grader: bad answer format",
            "validation_error",
        )
        assert document["extra"]["osmosis"]["reward"] == 0.3
        diagnostics = json.loads((tmp_path / "r1" / "diagnostics.json").read_text())
        assert "ValueError" in diagnostics["grader_error"]["traceback"]

    async def test_cancelled(self, tmp_path: Path) -> None:
        """A rollout cancelled while grading saves its conversation as valid ATIF, marked
        cancelled, with no reward."""
        grading = asyncio.Event()

        class HangingGrader(Grader):
            async def grade(self, ctx: GraderContext) -> None:
                grading.set()
                await asyncio.Event().wait()

        backend = LocalBackend(ToolWorkflow, grader=HangingGrader, artifact_root=tmp_path)
        task = asyncio.create_task(backend.execute(request_for("c1", label="42")))
        async with asyncio.timeout(WAIT_SEC):
            await grading.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await backend.shutdown()  # waits for the cancelled rollout's write
        document, _ = saved(tmp_path, "c1")
        assert document["steps"] == conversation_steps(TOOL_CONVERSATION)
        assert document["extra"]["rollout_server"]["status"] == "cancelled"
        assert "reward" not in document["extra"]["osmosis"]
