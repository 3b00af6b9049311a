"""The Grafana dashboard in ``examples/grafana/`` queries only metrics the server exports,
and shows every rollout metric it exports."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from rollout_server import (
    AgentWorkflow,
    AgentWorkflowConfig,
    AgentWorkflowOutput,
    Grader,
    GraderContext,
    LocalBackend,
    WorkflowContext,
)

DASHBOARD = Path(__file__).resolve().parents[3] / "examples" / "grafana" / "rollout-server.json"
METRIC_NAME = re.compile(r"\b((?:rollout|process)_[a-z0-9_]+)\b")


class Answer(AgentWorkflow):
    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        return AgentWorkflowOutput(messages=[*ctx.prompt, {"role": "assistant", "content": "4"}])


class One(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        ctx.set_reward(1.0)


def queries(node: Any) -> list[str]:
    """Every PromQL string of the dashboard: targets' ``expr`` and variables' queries."""
    found: list[str] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                found.append(value)
            else:
                found.extend(queries(value))
    elif isinstance(node, list):
        for item in node:
            found.extend(queries(item))
    return found


async def exported_samples(make_harness: Any, tmp_path: Path) -> set[str]:
    """The sample names a LocalBackend server with limits exports after one rollout."""
    backend = LocalBackend(
        Answer,
        workflow_config=AgentWorkflowConfig(name="w", concurrency={"max_concurrent": 2}),
        grader=One,
        max_queued=4,
        artifact_root=tmp_path,
    )
    harness = await make_harness(backend=backend)
    token = await harness.admit("r1")
    reply = await harness.poll_until("r1", token, "success", "failure", "cancelled")
    assert reply.json["status"] == "success"
    scraped = await harness.request("GET", "/metrics")
    assert scraped.status == 200
    return {
        sample.name
        for family in text_string_to_metric_families(scraped.raw.decode())
        for sample in family.samples
    }


class TestGrafanaDashboard:
    async def test_every_queried_metric_is_exported(
        self, make_harness: Any, tmp_path: Path
    ) -> None:
        """Each metric name in the dashboard's queries is a sample name of ``/metrics``."""
        document = json.loads(await asyncio.to_thread(DASHBOARD.read_text, "utf-8"))
        names = {name for query in queries(document) for name in METRIC_NAME.findall(query)}
        assert len(names) > 20
        missing = names - await exported_samples(make_harness, tmp_path)
        assert not missing, f"the dashboard queries metrics /metrics does not export: {missing}"

    async def test_every_rollout_metric_is_on_the_dashboard(
        self, make_harness: Any, tmp_path: Path
    ) -> None:
        """Each ``rollout_`` family the server exports is queried by some panel (or the
        server variable)."""
        text = await asyncio.to_thread(DASHBOARD.read_text, "utf-8")
        exported = await exported_samples(make_harness, tmp_path)
        families = {
            re.sub(r"_(bucket|sum|count|total|created)$", "", name)
            for name in exported
            if name.startswith("rollout_")
        }
        unshown = {family for family in families if family not in text}
        assert not unshown, f"exported but on no panel: {unshown}"
