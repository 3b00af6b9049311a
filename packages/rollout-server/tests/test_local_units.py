"""Units under LocalBackend: the limiter, error categories, configs, import strings, roots."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import pickle
import textwrap
from pathlib import Path
from typing import Any

import attrs
import pytest

from rollout_server import (
    AgentWorkflow,
    AgentWorkflowConfig,
    AgentWorkflowOutput,
    ConcurrencyConfig,
    ExecutionOutcome,
    ExecutionRequest,
    ExecutionResult,
    Grader,
    GraderConfig,
    GraderContext,
    LocalBackend,
    RolloutContext,
    Sample,
    WorkflowContext,
    categorize_exception,
    current_rollout_context,
    get_rollout_context,
)
from rollout_server.execution._context import bind_rollout_context
from rollout_server.execution._imports import resolve_import_string
from rollout_server.execution._limiter import ConcurrencyLimiter
from rollout_server.execution._trajectory import (
    RolloutFacts,
    RolloutFiles,
    default_artifact_root,
    diagnostics_document,
    trajectory_document,
    write_json_atomic,
)
from rollout_types import RolloutErrorCategory, RolloutStatus

WAIT_SEC = 5.0


class EchoWorkflow(AgentWorkflow):
    async def run(self, ctx: WorkflowContext) -> list[dict[str, Any]]:
        return list(ctx.prompt)


class HalfGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        ctx.set_reward(0.5)


async def _until(predicate: Any) -> None:
    """Yield to the loop until ``predicate()`` holds (bounded).

    The limiter's counts have no event to wait on; this only yields, it never sleeps.
    """
    async with asyncio.timeout(WAIT_SEC):
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0)


class TestConcurrencyLimiter:
    async def test_counts_waiters_and_holders(self) -> None:
        """With one slot, the first caller holds it and the next two wait, in the counts."""
        limiter = ConcurrencyLimiter(1)
        await limiter.acquire()
        waiters = [asyncio.create_task(limiter.acquire()) for _ in range(2)]
        await _until(lambda: limiter.queued == 2)
        assert limiter.snapshot() == {"max_concurrent": 1, "queued": 2, "running": 1}
        limiter.release()
        await asyncio.wait_for(waiters[0], WAIT_SEC)
        assert (limiter.queued, limiter.running) == (1, 1)
        assert not waiters[1].done()
        limiter.release()
        await asyncio.wait_for(waiters[1], WAIT_SEC)
        limiter.release()
        assert (limiter.queued, limiter.running) == (0, 0)

    async def test_cancelled_waiter_leaves_the_queue(self) -> None:
        """A cancelled waiter leaves the queue at once and never takes a slot."""
        limiter = ConcurrencyLimiter(1)
        await limiter.acquire()
        waiter = asyncio.create_task(limiter.acquire())
        await _until(lambda: limiter.queued == 1)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert (limiter.queued, limiter.running) == (0, 1)
        limiter.release()
        assert limiter.running == 0

    async def test_slot_handed_to_a_cancelled_waiter_is_passed_on(self) -> None:
        """A slot handed over in the instant its waiter is cancelled goes to the next one."""
        limiter = ConcurrencyLimiter(1)
        await limiter.acquire()
        first = asyncio.create_task(limiter.acquire())
        second = asyncio.create_task(limiter.acquire())
        await _until(lambda: limiter.queued == 2)
        limiter.release()  # hands the slot to `first` ...
        first.cancel()  # ... which is cancelled before it resumes
        with pytest.raises(asyncio.CancelledError):
            await first
        await asyncio.wait_for(second, WAIT_SEC)
        assert (limiter.queued, limiter.running) == (0, 1)

    async def test_unlimited_never_queues(self) -> None:
        """Without a limit every caller gets a slot at once and queued stays 0."""
        limiter = ConcurrencyLimiter(None)
        for _ in range(50):
            await limiter.acquire()
        assert limiter.snapshot() == {"max_concurrent": None, "queued": 0, "running": 50}

    def test_release_without_acquire_is_an_error(self) -> None:
        """Releasing more often than acquiring raises instead of corrupting the counts."""
        with pytest.raises(RuntimeError, match="more often"):
            ConcurrencyLimiter(2).release()

    @pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
    def test_rejects_bad_limits(self, bad: Any) -> None:
        """A limit that is not an int of at least 1 (or None) is refused with a clear error."""
        with pytest.raises(ValueError, match="max_concurrent must be an int of at least 1"):
            ConcurrencyLimiter(bad)


class SandboxRateLimitException(Exception):  # noqa: N818 - the provider's name
    pass


class SandboxApiException(Exception):  # noqa: N818 - the provider's name
    def __init__(self, status_code: Any) -> None:
        super().__init__(f"status {status_code}")
        self.status_code = status_code


class ProviderError(SandboxApiException):
    pass


class TestCategorizeException:
    @pytest.mark.parametrize(
        ("exc", "category"),
        [
            (TimeoutError("t"), RolloutErrorCategory.TIMEOUT),
            (TimeoutError(), RolloutErrorCategory.TIMEOUT),
            (ValueError("v"), RolloutErrorCategory.VALIDATION_ERROR),
            (TypeError("t"), RolloutErrorCategory.VALIDATION_ERROR),
            (AssertionError("a"), RolloutErrorCategory.VALIDATION_ERROR),
            (json.JSONDecodeError("bad", "x", 0), RolloutErrorCategory.VALIDATION_ERROR),
            (
                UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"),
                RolloutErrorCategory.VALIDATION_ERROR,
            ),
            (RuntimeError("boom"), RolloutErrorCategory.AGENT_ERROR),
            (KeyError("k"), RolloutErrorCategory.AGENT_ERROR),
            (SandboxRateLimitException(), RolloutErrorCategory.HTTP_ERROR),
            (SandboxApiException(503), RolloutErrorCategory.HTTP_ERROR),
            (ProviderError(429), RolloutErrorCategory.HTTP_ERROR),
            (SandboxApiException(404), RolloutErrorCategory.AGENT_ERROR),
            (SandboxApiException("503"), RolloutErrorCategory.AGENT_ERROR),
            (SandboxApiException(True), RolloutErrorCategory.AGENT_ERROR),
        ],
    )
    def test_categories(self, exc: BaseException, category: RolloutErrorCategory) -> None:
        """Each exception gets the category of spec section 5.6 (MRO names, status codes)."""
        assert categorize_exception(exc) is category


class TestConfigs:
    def test_defaults(self) -> None:
        """A config needs only a name; its concurrency has no limit by default."""
        config = AgentWorkflowConfig(name="w")
        assert config.description is None
        assert config.concurrency == ConcurrencyConfig(max_concurrent=None)
        assert config.extra == {}

    def test_deep_copy_shares_only_immutable_values(self) -> None:
        """A deep copy equals the original; nested mutable settings (in ``extra`` or in a
        subclass's own fields) are copies, while strings and the frozen concurrency are
        shared."""

        @attrs.frozen(kw_only=True)
        class ToolConfig(AgentWorkflowConfig):
            tools: list[str] = attrs.field(factory=list)

        config = ToolConfig.from_mapping(
            {"name": "w", "tools": ["calc"], "limits": {"turns": [1, 2]}, "model": "m"}
        )
        copied = copy.deepcopy(config)
        assert copied == config
        assert copied is not config
        assert copied.tools is not config.tools
        assert copied.extra["limits"]["turns"] is not config.extra["limits"]["turns"]
        assert copied.concurrency is config.concurrency
        assert copied.name is config.name
        empty = AgentWorkflowConfig(name="e")
        assert copy.deepcopy(empty).extra is not empty.extra

    def test_deep_copy_of_a_subclass_without_slots(self) -> None:
        """A config subclass without slots keeps (copies of) its instance attributes."""

        @attrs.frozen(kw_only=True, slots=False)
        class Loose(AgentWorkflowConfig):
            pass

        config = Loose.from_mapping({"name": "w", "model": "m"})
        object.__setattr__(config, "cache", [1])
        copied = copy.deepcopy(config)
        assert copied == config
        assert copied.cache == [1]
        assert copied.cache is not config.cache

    def test_from_mapping_keeps_extra_keys(self) -> None:
        """Unknown keys of a mapping land in ``extra`` and read back with ``get``."""
        config = AgentWorkflowConfig.from_mapping(
            {"name": "w", "concurrency": {"max_concurrent": 2}, "model": "m", "temperature": 0.2}
        )
        assert config.concurrency.max_concurrent == 2
        assert config.extra == {"model": "m", "temperature": 0.2}
        assert config.get("model") == "m"
        assert config.get("absent", 7) == 7

    def test_grader_config(self) -> None:
        """A grader config has the same fields."""
        config = GraderConfig.from_mapping({"name": "g", "description": "d", "strict": True})
        assert (config.name, config.description, config.get("strict")) == ("g", "d", True)

    @pytest.mark.parametrize(
        ("kwargs", "error", "match"),
        [
            ({"name": ""}, ValueError, "non-empty"),
            ({"name": "w", "concurrency": {"max_concurrent": 0}}, ValueError, "at least 1"),
            ({"name": "w", "concurrency": {"limit": 2}}, ValueError, "unknown keys"),
            ({"name": "w", "concurrency": 3}, TypeError, "ConcurrencyConfig or a mapping"),
            ({"name": "w", "description": 3}, TypeError, "description"),
        ],
    )
    def test_invalid_values(
        self, kwargs: dict[str, Any], error: type[Exception], match: str
    ) -> None:
        """Invalid fields fail at construction with a message naming the field."""
        with pytest.raises(error, match=match):
            AgentWorkflowConfig(**kwargs)

    def test_from_mapping_needs_a_name(self) -> None:
        """A mapping without a name is refused."""
        with pytest.raises(ValueError, match="needs a 'name'"):
            AgentWorkflowConfig.from_mapping({"model": "m"})

    def test_extra_keyword_arguments(self) -> None:
        """Extra keyword arguments are kept in ``extra`` and read back as attributes."""
        config = AgentWorkflowConfig(name="w", model="m", extra={"seed": 1})
        assert config.extra == {"seed": 1, "model": "m"}
        assert (config.model, config.seed, config.get("model")) == ("m", 1, "m")
        with pytest.raises(AttributeError, match="no field or extra setting 'absent'"):
            _ = config.absent
        grader = GraderConfig(name="g", strict=True)
        assert grader.strict is True

    def test_constructor_needs_a_name(self) -> None:
        """A config built without a name is refused."""
        with pytest.raises(TypeError, match="name"):
            AgentWorkflowConfig(model="m")  # type: ignore[call-arg]

    def test_copies_keep_extras(self) -> None:
        """Deep copies and pickles keep the extra settings."""
        config = AgentWorkflowConfig(name="w", concurrency={"max_concurrent": 2}, model="m")
        assert copy.deepcopy(config) == config
        assert pickle.loads(pickle.dumps(config)) == config  # noqa: S301 - our own bytes

    def test_typed_subclass(self) -> None:
        """A subclass with typed fields fills them from a mapping; other keys go to extra."""

        @attrs.frozen(kw_only=True)
        class TypedConfig(AgentWorkflowConfig):
            model: str = "small"

        config = TypedConfig.from_mapping({"name": "t", "model": "big", "seed": 3})
        assert (config.model, config.seed, config.extra) == ("big", 3, {"seed": 3})
        assert TypedConfig(name="t").model == "small"


class TestWorkflowOutput:
    def test_rejects_non_finite_metrics(self) -> None:
        """Metrics must be finite numbers."""
        with pytest.raises(ValueError, match="finite"):
            AgentWorkflowOutput(messages=[], metrics={"x": float("nan")})
        with pytest.raises(TypeError, match="must be a number"):
            AgentWorkflowOutput(messages=[], metrics={"x": "1"})  # type: ignore[dict-item]

    def test_rejects_non_dict_messages(self) -> None:
        """Each message must be a dict."""
        with pytest.raises(TypeError, match=r"messages\[1\] must be a dict"):
            AgentWorkflowOutput(messages=[{}, "hi"])  # type: ignore[list-item]

    def test_forbids_extra_keys(self) -> None:
        """Unknown keyword arguments are refused."""
        with pytest.raises(TypeError):
            AgentWorkflowOutput(messages=[], score=1.0)  # type: ignore[call-arg]


class TestRolloutContext:
    def test_environment_fallbacks(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """An empty URL and a missing or empty key fall back to the OSMOSIS_* variables;
        request values win when given."""
        monkeypatch.setenv("OSMOSIS_CHAT_COMPLETIONS_URL", "http://127.0.0.1:7/v1")
        monkeypatch.setenv("OSMOSIS_API_KEY", "sk-env")
        for key in (None, ""):
            context = RolloutContext.from_request(
                rollout_id="r",
                chat_completions_url="",
                llm_api_key=key,
                process_id="p",
                on_status=lambda _status: None,
            )
            assert (context.chat_completions_url, context.api_key) == (
                "http://127.0.0.1:7/v1",
                "sk-env",
            )
        given = RolloutContext.from_request(
            rollout_id="r",
            chat_completions_url="http://127.0.0.1:8/v1",
            llm_api_key="sk-req",
            process_id="p",
            on_status=lambda _status: None,
        )
        assert (given.chat_completions_url, given.api_key) == ("http://127.0.0.1:8/v1", "sk-req")
        assert "sk-req" not in repr(given)

    def test_no_key_anywhere(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Without a key in the request or the environment, api_key is None."""
        monkeypatch.delenv("OSMOSIS_API_KEY", raising=False)
        context = RolloutContext(rollout_id="r", chat_completions_url="u")
        assert context.api_key is None

    async def test_binding_and_status(self) -> None:
        """The bound context is reachable inside the block only, and forwards statuses."""
        seen: list[RolloutStatus] = []
        context = RolloutContext(rollout_id="r", chat_completions_url="u", on_status=seen.append)
        assert current_rollout_context() is None
        with pytest.raises(RuntimeError, match="no rollout context"):
            get_rollout_context()
        with bind_rollout_context(context):
            assert get_rollout_context() is context
            get_rollout_context().set_status(RolloutStatus.RUNNING)
            assert await context.get_sample() is None  # no source registered
        assert current_rollout_context() is None
        assert seen == [RolloutStatus.RUNNING]


class TestGraderContext:
    def test_set_reward(self) -> None:
        """set_reward stores a float on the sample; non-finite values are refused."""
        ctx = GraderContext(rollout_id="r", sample=Sample())
        ctx.set_reward(1)
        assert ctx.sample is not None
        assert ctx.sample.reward == 1.0
        with pytest.raises(ValueError, match="finite"):
            ctx.set_reward(float("inf"))
        with pytest.raises(ValueError, match="finite"):
            ctx.set_reward(True)

    def test_no_sample(self) -> None:
        """Without a sample, set_reward raises the osmosis message."""
        with pytest.raises(ValueError, match=r"^GraderContext has no sample to reward$"):
            GraderContext(rollout_id="r").set_reward(0.5)

    def test_remove_sample(self) -> None:
        """set_remove_sample flags the sample."""
        ctx = GraderContext(rollout_id="r", sample=Sample())
        ctx.set_remove_sample()
        assert ctx.sample is not None
        assert ctx.sample.remove_sample is True


class TestImportStrings:
    @pytest.fixture
    def module(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
        source = textwrap.dedent(
            """
            from rollout_server import AgentWorkflow, AgentWorkflowConfig, Grader

            class Flow(AgentWorkflow):
                async def run(self, ctx):
                    return []

            class Score(Grader):
                async def grade(self, ctx):
                    ctx.set_reward(1.0)

            class Holder:
                Flow = Flow

            CONFIG = AgentWorkflowConfig(name="from-module", concurrency={"max_concurrent": 3})
            RAW = {"name": "raw"}
            NOT_A_CLASS = 3
            """
        )
        (tmp_path / "lb_user_module.py").write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))
        return "lb_user_module"

    def test_resolves_classes_and_configs(self, module: str) -> None:
        """Classes, nested attributes and configs resolve from import strings."""
        backend = LocalBackend(
            workflow=f"{module}:Holder.Flow",
            workflow_config=f"{module}:CONFIG",
            grader=f"{module}:Score",
            grader_config=f"{module}:RAW",
        )
        assert backend.max_concurrent == 3

    @pytest.mark.parametrize("spec", ["no_colon", ":Attr", "module:", "  :  "])
    def test_malformed(self, spec: str) -> None:
        """A string that is not module:attr is a ValueError saying the expected form."""
        with pytest.raises(ValueError, match=r"must look like 'package\.module:Attr'"):
            resolve_import_string(spec, what="workflow")

    def test_missing_module(self) -> None:
        """A missing module is an ImportError naming it."""
        with pytest.raises(ImportError, match="cannot import module 'no_such_module_xyz'"):
            LocalBackend(workflow="no_such_module_xyz:Flow")

    def test_missing_attribute(self, module: str) -> None:
        """A missing attribute is an ImportError naming the attribute."""
        with pytest.raises(ImportError, match="has no attribute 'Nope'"):
            LocalBackend(workflow=f"{module}:Nope")
        with pytest.raises(ImportError, match="'lb_user_module:Holder' has no attribute 'X'"):
            LocalBackend(workflow=f"{module}:Holder.X")

    def test_a_module_that_fails_to_import(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """An exception raised by the module's own code while it is imported is an
        ImportError that names the module and the error, chaining it."""
        (tmp_path / "lb_broken_module.py").write_text("raise RuntimeError('boom')\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        with pytest.raises(
            ImportError,
            match=r"importing module 'lb_broken_module' named by workflow "
            r"'lb_broken_module:Flow' failed: RuntimeError: boom",
        ) as info:
            LocalBackend(workflow="lb_broken_module:Flow")
        assert isinstance(info.value.__cause__, RuntimeError)

    def test_a_missing_dependency_is_not_a_missing_module(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A module that exists but imports a missing one is reported as a failed import
        naming the missing dependency, not as a missing module."""
        (tmp_path / "lb_needy_module.py").write_text("import no_such_dependency_xyz\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        with pytest.raises(ImportError) as info:
            resolve_import_string("lb_needy_module:Flow", what="workflow")
        message = str(info.value)
        assert message.startswith("importing module 'lb_needy_module' named by workflow")
        assert "No module named 'no_such_dependency_xyz'" in message
        assert isinstance(info.value.__cause__, ModuleNotFoundError)

    def test_missing_module_hint(self) -> None:
        """The caller's hint says where a missing module was looked for and how to fix it."""
        with pytest.raises(ImportError, match=r"no_such_module_xyz.*: look elsewhere$"):
            resolve_import_string(
                "no_such_module_xyz:X", what="target", missing_module_hint="look elsewhere"
            )

    def test_wrong_kind(self, module: str) -> None:
        """An import string naming something that is not a workflow class is a TypeError."""
        with pytest.raises(TypeError, match="subclass of AgentWorkflow"):
            LocalBackend(workflow=f"{module}:NOT_A_CLASS")
        with pytest.raises(TypeError, match="must be a AgentWorkflowConfig"):
            LocalBackend(workflow=f"{module}:Flow", workflow_config=f"{module}:NOT_A_CLASS")


class TestLocalBackendConstruction:
    def test_instance_instead_of_class(self, tmp_path: Path) -> None:
        """Passing a workflow instance says to pass the class."""
        with pytest.raises(TypeError, match="must be a class, not an instance"):
            LocalBackend(workflow=EchoWorkflow(), artifact_root=tmp_path)  # type: ignore[arg-type]

    def test_abstract_class(self, tmp_path: Path) -> None:
        """The abstract base itself is refused."""
        with pytest.raises(TypeError, match="abstract"):
            LocalBackend(workflow=AgentWorkflow, artifact_root=tmp_path)

    def test_abstract_class_names_what_to_implement(self, tmp_path: Path) -> None:
        """A grader class that does not implement grade() is refused, naming grade()."""

        class Unfinished(Grader):
            pass

        with pytest.raises(TypeError, match=r"Unfinished is abstract: implement grade\(\)$"):
            LocalBackend(EchoWorkflow, grader=Unfinished, artifact_root=tmp_path)

    def test_grader_must_be_a_grader(self, tmp_path: Path) -> None:
        """A grader that is not a Grader subclass is refused."""
        with pytest.raises(TypeError, match="subclass of Grader"):
            LocalBackend(EchoWorkflow, grader=EchoWorkflow, artifact_root=tmp_path)  # type: ignore[arg-type]

    def test_concurrency_from_config(self, tmp_path: Path) -> None:
        """No config means 4 slots; a config's None means no limit; a mapping is accepted."""
        assert LocalBackend(EchoWorkflow, artifact_root=tmp_path).max_concurrent == 4
        unlimited = LocalBackend(
            EchoWorkflow, workflow_config=AgentWorkflowConfig(name="w"), artifact_root=tmp_path
        )
        assert unlimited.max_concurrent is None
        mapped = LocalBackend(
            EchoWorkflow,
            workflow_config={"name": "w", "concurrency": {"max_concurrent": 2}},
            artifact_root=tmp_path,
        )
        assert mapped.max_concurrent == 2

    @pytest.mark.parametrize("bad", [-1, True, 1.0, "3"])
    def test_rejects_bad_max_queued(self, tmp_path: Path, bad: Any) -> None:
        """max_queued must be an int >= 0 or None."""
        with pytest.raises(ValueError, match="max_queued must be an int >= 0"):
            LocalBackend(EchoWorkflow, max_queued=bad, artifact_root=tmp_path)

    def test_max_queued_needs_a_limit(self, tmp_path: Path) -> None:
        """A queue bound without a concurrency limit is refused, naming the fix."""
        with pytest.raises(ValueError, match="needs a concurrency limit"):
            LocalBackend(
                EchoWorkflow,
                workflow_config=AgentWorkflowConfig(name="free"),
                max_queued=3,
                artifact_root=tmp_path,
            )

    def test_health_shape(self, tmp_path: Path) -> None:
        """health() reports the concurrency counters and the queue bound."""
        backend = LocalBackend(EchoWorkflow, max_queued=7, artifact_root=tmp_path)
        assert backend.health() == {
            "status": "ok",
            "concurrency": {"max_concurrent": 4, "queued": 0, "running": 0, "max_queued": 7},
        }

    def test_config_must_be_deep_copyable(self, tmp_path: Path) -> None:
        """A config that cannot be deep-copied is refused at construction."""

        class Unpicklable:
            def __deepcopy__(self, memo: Any) -> Any:
                raise TypeError("no copies")

        config = AgentWorkflowConfig(name="w", extra={"thing": Unpicklable()})
        with pytest.raises(TypeError, match="deep-copyable"):
            LocalBackend(EchoWorkflow, workflow_config=config, artifact_root=tmp_path)


class TestArtifactRoot:
    def test_environment_order(self, tmp_path: Path) -> None:
        """ROLLOUT_ARTIFACT_ROOT wins, then the osmosis variable, then XDG, then home."""
        ours, theirs, xdg = tmp_path / "a", tmp_path / "b", tmp_path / "x"
        env = {
            "ROLLOUT_ARTIFACT_ROOT": str(ours),
            "_OSMOSIS_ROLLOUT_ARTIFACT_ROOT": str(theirs),
            "XDG_STATE_HOME": str(xdg),
        }
        assert default_artifact_root(env) == ours
        del env["ROLLOUT_ARTIFACT_ROOT"]
        assert default_artifact_root(env) == theirs
        del env["_OSMOSIS_ROLLOUT_ARTIFACT_ROOT"]
        assert default_artifact_root(env) == xdg / "rollout" / "artifacts"
        env["XDG_STATE_HOME"] = "relative/path"
        assert default_artifact_root(env) == Path.home() / ".local/state/rollout/artifacts"

    def test_tests_never_write_under_the_home_directory(self) -> None:
        """In the test session, a backend built without artifact_root (and a server
        subprocess, which inherits the environment) keeps its files out of the home
        directory (the root conftest points the variables into pytest's temp dir)."""
        root = LocalBackend(EchoWorkflow).artifact_root
        assert not root.is_relative_to(Path.home()), root
        assert not default_artifact_root().is_relative_to(Path.home())

    def test_read_once_at_construction(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The backend reads the environment when it is built, not later."""
        monkeypatch.setenv("ROLLOUT_ARTIFACT_ROOT", str(tmp_path / "first"))
        backend = LocalBackend(EchoWorkflow)
        monkeypatch.setenv("ROLLOUT_ARTIFACT_ROOT", str(tmp_path / "second"))
        assert backend.artifact_root == tmp_path / "first"
        assert LocalBackend(EchoWorkflow, artifact_root=tmp_path / "arg").artifact_root == (
            tmp_path / "arg"
        )

    def test_atomic_write_leaves_no_temporary_file(self, tmp_path: Path) -> None:
        """An atomic write leaves only the target."""
        target = tmp_path / "doc.json"
        write_json_atomic(target, b'{"a":1}\n')
        assert json.loads(target.read_text()) == {"a": 1}
        assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.json"]


class TestCopies:
    def test_json_values_are_copied_deeply(self) -> None:
        """Nested dicts and lists are new objects with equal content; scalars are kept;
        other objects inside are deep-copied."""
        from rollout_server.execution._copying import copy_json

        class Box:
            def __init__(self) -> None:
                self.items = [1]

        value = {"a": [{"b": "c", "n": 1.5}], "box": Box(), "t": (1, [2])}
        copied = copy_json(value)
        assert copied["a"] == value["a"]
        assert copied["a"] is not value["a"]
        assert copied["a"][0] is not value["a"][0]
        assert copied["box"] is not value["box"]
        assert copied["box"].items == [1]
        assert copied["t"] == (1, [2])
        assert copied["t"][1] is not value["t"][1]

    def test_snapshot_of_cyclic_and_uncopyable_messages(self) -> None:
        """A message list with a cycle is deep-copied with the cycle kept; one holding
        something that cannot be copied gets a shallow snapshot."""
        import threading

        from rollout_server.execution._copying import snapshot_messages

        cyclic: dict[str, Any] = {"role": "user"}
        cyclic["self"] = cyclic
        (copied,) = snapshot_messages([cyclic])
        assert copied is not cyclic
        assert copied["self"] is copied
        lock_message = {"role": "tool", "lock": threading.Lock()}
        (shallow,) = snapshot_messages([lock_message])
        assert shallow is not lock_message
        assert shallow["lock"] is lock_message["lock"]


def _facts(outcome: ExecutionOutcome, rollout_id: str = "r1", **kwargs: Any) -> RolloutFacts:
    request = ExecutionRequest(
        id=rollout_id, prompt=[{"role": "user", "content": "hi"}], chat_completions_url="x"
    )
    timings = {"queued_sec": 0.0, "workflow_sec": 0.1, "grader_sec": None, "total_sec": 0.1}
    return RolloutFacts(request=request, outcome=outcome, timings=timings, **kwargs)


def _said(text: str) -> list[dict[str, Any]]:
    return [{"role": "assistant", "content": text}]


class TestTrajectoryDocuments:
    def test_the_saved_sample_is_the_graders_when_it_has_one(self) -> None:
        """The ATIF document holds the grader's sample when the grader has one, else the
        workflow's, and the reported status unless the facts say otherwise."""
        mine = Sample(messages=_said("w"), trajectory_messages=_said("w"), reward=None)
        graded = Sample(messages=_said("g"), trajectory_messages=_said("g"), reward=1.0)
        success = ExecutionResult(status=RolloutStatus.SUCCESS, sample=mine)
        both = ExecutionOutcome(
            workflow=success, grader=ExecutionResult(status=RolloutStatus.SUCCESS, sample=graded)
        )
        document = trajectory_document(_facts(both))
        assert document is not None
        assert [step["message"] for step in document["steps"]] == ["g"]
        assert document["extra"]["osmosis"]["reward"] == 1.0
        record = document["extra"]["rollout_server"]
        assert record["phases"]["grader"]["status"] == "success"
        bare = ExecutionOutcome(
            workflow=success, grader=ExecutionResult(status=RolloutStatus.FAILURE)
        )
        document = trajectory_document(_facts(bare))
        assert document is not None
        assert [step["message"] for step in document["steps"]] == ["w"]
        assert document["extra"]["rollout_server"]["status"] == "failure"
        cancelled = ExecutionResult(status=RolloutStatus.CANCELLED, err_message="cancelled")
        document = trajectory_document(_facts(bare, reported=cancelled))
        assert document is not None
        record = document["extra"]["rollout_server"]
        assert (record["status"], record["err_message"]) == ("cancelled", "cancelled")

    def test_no_conversation_no_document(self) -> None:
        """Without a saved sample holding trajectory messages there is no document."""
        plain = ExecutionResult(status=RolloutStatus.SUCCESS)
        assert trajectory_document(_facts(ExecutionOutcome(workflow=plain))) is None
        unsent = ExecutionResult(status=RolloutStatus.SUCCESS, sample=Sample(messages=_said("w")))
        assert trajectory_document(_facts(ExecutionOutcome(workflow=unsent))) is None

    def test_diagnostics_merge_the_phases_or_are_none(self) -> None:
        """Diagnostics merge both phases' extra fields; without any there is no document."""
        workflow = ExecutionResult(
            status=RolloutStatus.SUCCESS, sample=Sample(), extra_fields={"workflow_error": 1}
        )
        grader = ExecutionResult(status=RolloutStatus.FAILURE, extra_fields={"grader_error": 2})
        merged = diagnostics_document(_facts(ExecutionOutcome(workflow=workflow, grader=grader)))
        assert merged == {"workflow_error": 1, "grader_error": 2}
        plain = ExecutionResult(status=RolloutStatus.SUCCESS)
        assert diagnostics_document(_facts(ExecutionOutcome(workflow=plain))) is None


def _conversation() -> ExecutionOutcome:
    sample = Sample(messages=_said("a"), trajectory_messages=_said("a"))
    return ExecutionOutcome(workflow=ExecutionResult(status=RolloutStatus.SUCCESS, sample=sample))


class TestRolloutFiles:
    async def test_prepare_then_save(self, tmp_path: Path) -> None:
        """prepare() makes the rollout directory (not artifacts/) and save() writes the
        trajectory there before it returns."""
        files = RolloutFiles(tmp_path)
        artifacts = await files.prepare("r1")
        assert artifacts == str(tmp_path / "r1" / "artifacts")
        assert sorted(p.name for p in (tmp_path / "r1").iterdir()) == []
        await files.save(_facts(_conversation()))
        document = json.loads((tmp_path / "r1" / "trajectory.json").read_text())
        assert document["session_id"] == "r1"
        assert document["extra"]["rollout_server"]["status"] == "success"

    async def test_an_unsafe_id_keeps_no_files(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """An id that is not one path segment gets no directory and no write, with a
        WARNING from prepare()."""
        files = RolloutFiles(tmp_path)
        assert files.rollout_dir("../up") is None
        with caplog.at_level(logging.WARNING, logger="rollout_server"):
            assert await files.prepare("../up") is None
        assert "not a single path segment" in caplog.text
        outcome = ExecutionOutcome(workflow=ExecutionResult(status=RolloutStatus.SUCCESS))
        assert files.save_soon(_facts(outcome, "../up")) is None
        assert sorted(p.name for p in (tmp_path / ".").iterdir()) == []

    async def test_writes_in_the_background_are_waited_for(self, tmp_path: Path) -> None:
        """wait_for_writes() returns once a write started with save_soon() is on disk."""
        files = RolloutFiles(tmp_path)
        write = files.save_soon(_facts(_conversation()))
        assert write is not None
        assert not write.done()
        await files.wait_for_writes(WAIT_SEC)
        assert write.done()
        assert (tmp_path / "r1" / "trajectory.json").is_file()
