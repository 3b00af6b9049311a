"""The HTML report: what it shows, escaping, edge cases and its bounded size."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import html
import io
import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from rollout_client.eval import EvalInputError, EvalOptions, run_eval, write_report
from rollout_client.eval._cli import main
from rollout_client.eval.report import _data as report_data
from rollout_client.eval.report import find_run_dir, render_report
from rollout_client.eval.report._charts import (
    WIDTH,
    Series,
    equal_bins,
    histogram,
    share_bar,
    y_scale,
)
from rollout_client.eval.report._data import clip_conversation, load_run
from rollout_types import RolloutResultResponse, RolloutSample

SCRIPT = '<script>alert("pwned")</script>'


def conversation(label: str, answer: str) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": f"question {label} {SCRIPT}"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"x": "<b>1</b>"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
        {"role": "assistant", "content": answer},
    ]


def behaviour(plan: dict[str, str]) -> Any:
    """Label -> "pass", "wrong" (reward 0), "half" (0.5), "skip", "noreward", or a category."""

    async def behave(request: dict[str, Any], _cancelled: asyncio.Event) -> RolloutResultResponse:
        await asyncio.sleep(0)
        label, rid = request["label"], request["rollout_id"]
        kind = plan.get(label, "pass")
        rewards = {"pass": 1.0, "wrong": 0.0, "half": 0.5}
        if kind in rewards or kind in ("skip", "noreward"):
            return RolloutResultResponse(
                rollout_id=rid,
                status="success",
                sample=RolloutSample(
                    messages=conversation(label, f"The answer is {label}."),
                    reward=rewards.get(kind),
                    remove_sample=kind == "skip",
                    metrics={"turns": 2},
                ),
            )
        return RolloutResultResponse(
            rollout_id=rid,
            status="failure",
            err_category=kind,
            err_message=f"{kind} in row {label}: {SCRIPT}",
            sample=RolloutSample(messages=conversation(label, "I give up")),
        )

    return behave


async def make_run(
    fakes: Any,
    tmp_path: Path,
    plan: dict[str, str],
    *,
    rows: int = 5,
    n: int = 1,
    name: str = "run",
    admit: Any = None,
) -> Path:
    """Run a dataset of ``rows`` rows (labels "0".."rows-1") through a fake server
    (``admit``, when given, sees each admission first and may raise)."""
    dataset = tmp_path / "data.jsonl"
    dataset.write_text(
        "".join(
            json.dumps({"user_prompt": f"What is {i}?", "label": str(i)}) + "\n"
            for i in range(rows)
        )
    )
    server = fakes.FakeServer(behaviour(plan), admit=admit)
    report = await run_eval(
        EvalOptions(
            dataset=dataset,
            server_url="http://127.0.0.1:9",
            chat_url="http://127.0.0.1:9/v1",
            output=tmp_path / "out",
            name=name,
            n=n,
            progress="off",
            max_consecutive_infra_failures=0,
        ),
        stream=io.StringIO(),
        client_factory=server.factory,
    )
    return report.run_dir


async def refused_run(fakes: Any, tmp_path: Path) -> report_data.RunData:
    """A run of three items whose admissions were all refused (infrastructure failures)."""

    def refuse(_request: dict[str, Any]) -> None:
        raise aiohttp.ClientConnectionError("connection refused")

    data = load_run(await make_run(fakes, tmp_path, {}, rows=3, admit=refuse))
    assert [item.record.outcome if item.record else None for item in data.items] == [
        "infra_failure"
    ] * 3
    return data


def text_of(document: str) -> str:
    """The document's text with tags removed and entities decoded (what a reader sees)."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", document)).split())


class TestReportContent:
    async def test_the_report_shows_summary_charts_failures_and_items(
        self, fakes: Any, tmp_path: Path
    ) -> None:
        """The report has the summary numbers, charts, failures by category and item links."""
        run_dir = await make_run(
            fakes, tmp_path, {"1": "wrong", "2": "agent_error", "3": "lease_expired", "4": "half"}
        )
        path = write_report(run_dir)
        assert path == run_dir / "report.html"
        document = path.read_text(encoding="utf-8")
        text = text_of(document)
        assert "rollout-eval report: run" in text
        assert "1/4 with reward ≥ 1" in text  # pass rate: 1 of 4 scored items
        assert "0.375" in text  # mean reward (1 + 0 + 0 + 0.5) / 4
        assert document.count('<svg class="chart"') == 2  # reward and latency; n = 1
        assert "pass@k needs several runs per row" in text
        assert 'id="cat-agent_error"' in document
        assert 'id="cat-lease_expired"' in document
        assert "agent_error in row 2" in text
        for row in range(5):
            assert f'href="#item-{row}-0"' in document
            assert f'<details class="conversation" id="item-{row}-0">' in document
        assert "The answer is 4." in text
        assert "→ calculator" in text

    async def test_pass_at_k_is_charted_for_repeated_runs(self, fakes: Any, tmp_path: Path) -> None:
        """With --n 4 the report draws pass@1, pass@2 and pass@4 and names every run of a row."""
        run_dir = await make_run(fakes, tmp_path, {"1": "wrong"}, rows=2, n=4)
        document = render_report(load_run(run_dir))
        assert 'aria-labelledby="chart-pass-at-k-title chart-pass-at-k-desc"' in document
        for k in (1, 2, 4):
            assert f"pass@{k}: " in document
        assert "row 1 · run 3" in document

    async def test_user_text_is_escaped_and_only_the_report_script_runs(
        self, fakes: Any, tmp_path: Path
    ) -> None:
        """Markup in messages, errors and the run name is text; the CSP allows one script."""
        run_dir = await make_run(fakes, tmp_path, {"2": "agent_error"}, name="<em>run")
        document = write_report(run_dir).read_text(encoding="utf-8")
        assert SCRIPT not in document
        assert "<em>" not in document
        assert "rollout-eval report: &lt;em&gt;run" in document
        assert html.escape(SCRIPT) in document
        assert document.count("<script") == 1
        script = document.split("<script>")[1].split("</script>")[0]
        digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
        assert f"script-src 'sha256-{digest}'" in document
        assert "default-src 'none'" in document
        assert "http://" not in document.split("<body>")[0].replace("http://www.w3.org", "")

    async def test_the_report_is_computed_from_the_journal_not_a_stale_summary(
        self, fakes: Any, tmp_path: Path
    ) -> None:
        """A missing summary.json is noted; the numbers come from events.jsonl."""
        run_dir = await make_run(fakes, tmp_path, {"0": "wrong"})
        (run_dir / "summary.json").unlink()
        data = load_run(run_dir)
        assert data.summary["pass"]["passed"] == 4
        assert data.summary["items"]["total"] == 5
        assert any("summary.json is missing" in note for note in data.notes)
        assert "summary.json is missing" in render_report(data)

    async def test_unreadable_sample_lines_are_reported(self, fakes: Any, tmp_path: Path) -> None:
        """A torn line of samples.jsonl is named in a note; the other conversations show."""
        run_dir = await make_run(fakes, tmp_path, {})
        with (run_dir / "samples.jsonl").open("a") as file:
            file.write('{"rollout_id": "cut sho')
        data = load_run(run_dir)
        assert sum(item.conversation is not None for item in data.items) == 5
        assert any("1 line of samples.jsonl could not be read (line 6)" in n for n in data.notes)


class TestEdgeCases:
    def test_a_run_with_no_items_renders(self, tmp_path: Path) -> None:
        """A manifest selecting no rows gives a report that says so, without charts."""
        run_dir = tmp_path / "empty"
        run_dir.mkdir()
        manifest = {
            "format": 1,
            "inputs": {
                "dataset_sha256": "0" * 64,
                "rows": "",
                "n": 1,
                "agent_timeout_sec": None,
                "grader_timeout_sec": None,
            },
        }
        (run_dir / "manifest.json").write_text(json.dumps(manifest))
        text = text_of(write_report(run_dir).read_text(encoding="utf-8"))
        assert "This run has no items." in text
        assert "No scored items yet." in text
        assert "No failures." in text

    async def test_a_run_of_only_failures_renders(self, fakes: Any, tmp_path: Path) -> None:
        """Every item failing (scored and infrastructure) still gives charts and the failures."""
        plan = {str(i): "agent_error" if i % 2 else "internal_error" for i in range(4)}
        run_dir = await make_run(fakes, tmp_path, plan, rows=4)
        document = write_report(run_dir).read_text(encoding="utf-8")
        text = text_of(document)
        assert "agent_error — 2 items (failed 2)" in text
        assert "internal_error — 2 items (infra_failure 2)" in text
        assert 'aria-labelledby="chart-reward-title' in document
        assert "0/2 with reward ≥ 1" in text

    async def test_no_samples_warning_when_no_result_came_back(
        self, fakes: Any, tmp_path: Path
    ) -> None:
        """A run whose admissions all failed has no samples.jsonl, and no note says so."""
        data = await refused_run(fakes, tmp_path)
        assert not (data.run_dir / "samples.jsonl").exists()
        assert not any("samples.jsonl" in note for note in data.notes)
        assert "samples.jsonl is missing" not in render_report(data)

    async def test_no_pass_rate_is_shown_as_such_when_nothing_was_scored(
        self, fakes: Any, tmp_path: Path
    ) -> None:
        """With no scored item the pass@k panel says there is no pass rate, not "pass@1 is
        the pass rate, (dash)"."""
        text = text_of(render_report(await refused_run(fakes, tmp_path)))
        assert "pass rate, \N{EN DASH}" not in text
        assert "no item was scored, so there is no pass rate either" in text

    async def test_the_latency_chart_points_to_the_times_of_failed_admissions(
        self, fakes: Any, tmp_path: Path
    ) -> None:
        """The items table lists the time to failure of infrastructure failures; the empty
        latency chart says so instead of "No latencies recorded yet"."""
        data = await refused_run(fakes, tmp_path)
        assert all(item.record and item.record.latency_sec is not None for item in data.items)
        text = text_of(render_report(data))
        assert "No latencies recorded yet" not in text
        assert "the time to failure of 3 items is in the items table" in text

    async def test_a_missing_samples_file_is_noted_when_results_came_back(
        self, fakes: Any, tmp_path: Path
    ) -> None:
        """samples.jsonl deleted after rollouts returned samples is still called missing."""
        run_dir = await make_run(fakes, tmp_path, {}, rows=2)
        (run_dir / "samples.jsonl").unlink()
        assert "samples.jsonl is missing" in render_report(load_run(run_dir))

    async def test_a_success_without_reward_and_a_skipped_item_render(
        self, fakes: Any, tmp_path: Path
    ) -> None:
        """A success without a reward is a failed no_reward item; a skipped one is not scored."""
        run_dir = await make_run(fakes, tmp_path, {"0": "noreward", "1": "skip"}, rows=2)
        data = load_run(run_dir)
        outcomes = [item.record.outcome for item in data.items if item.record]
        assert outcomes == ["failed", "skipped"]
        text = text_of(render_report(data))
        assert "no_reward — 1 item (failed 1)" in text

    async def test_huge_conversations_are_cut_to_a_bounded_size(
        self, fakes: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Each conversation shows its start and end within its budget; the file stays small."""
        monkeypatch.setattr(report_data, "CONVERSATION_BUDGET_CHARS", 40_000)
        run_dir = await make_run(fakes, tmp_path, {}, rows=4)
        path = run_dir / "samples.jsonl"
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        for line in lines:
            line["messages"] = [{"role": "user", "content": "first question"}] + [
                {"role": "assistant", "content": f"step {i} " + "y" * 50_000} for i in range(30)
            ]
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        report = write_report(run_dir)
        assert path.stat().st_size > 6_000_000
        assert report.stat().st_size < 80_000
        text = text_of(report.read_text(encoding="utf-8"))
        assert "first question" in text
        assert "step 29 " in text
        assert "messages not shown here: line 1 of samples.jsonl has them" in text
        assert "more characters not shown" in text

    async def test_large_runs_list_failures_first(
        self, fakes: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Beyond the listed-item limit, failures are listed first and the rest counted."""
        monkeypatch.setattr(report_data, "MAX_LISTED_ITEMS", 3)
        run_dir = await make_run(fakes, tmp_path, {"4": "agent_error", "2": "wrong"}, rows=6)
        data = load_run(run_dir)
        assert [item.key for item in data.items] == [(0, 0), (2, 0), (4, 0)]
        assert any("lists 3 of 6 items" in note for note in data.notes)
        assert len(data.final_records) == 6


class TestConversationClipping:
    def test_a_short_conversation_is_kept_whole(self) -> None:
        """Messages within the budget are all shown, nothing omitted."""
        head, tail, omitted = clip_conversation(conversation("1", "ok"), limit=10_000)
        assert [m.role for m in head] == ["user", "assistant", "tool", "assistant"]
        assert (tail, omitted) == ([], 0)

    def test_the_first_and_last_messages_are_kept(self) -> None:
        """Over the budget, the first message and the last ones that fit are shown."""
        messages = [{"role": "user", "content": "q"}] + [
            {"role": "assistant", "content": f"{i:03d}" + "z" * 97} for i in range(20)
        ]
        head, tail, omitted = clip_conversation(messages, limit=1000)
        assert [m.text for m in head] == ["q"]
        assert tail[-1].text.startswith("019")
        assert len(head) + len(tail) + omitted == 21
        assert sum(m.size for m in head + tail) <= 1000

    def test_odd_messages_are_shown_as_json(self) -> None:
        """Non-object messages, list content and extra fields are shown, not dropped."""
        head, _, _ = clip_conversation(
            [
                "just a string",
                {"role": "user", "content": [{"type": "text", "text": "part"}, {"x": 1}]},
                {"role": "assistant", "content": "a", "reasoning_content": "because"},
            ],
            limit=10_000,
        )
        assert (head[0].role, head[0].text) == ("?", '"just a string"')
        assert head[1].text == 'part\n{"x": 1}'
        assert head[2].text == "a\n[reasoning_content] because"


class TestCharts:
    def test_count_axes_use_round_steps(self) -> None:
        """The y axis tops at a round number with at most five whole-number steps."""
        assert y_scale(0) == (1, 1)
        assert y_scale(47) == (50, 10)
        assert y_scale(6) == (6, 2)
        assert y_scale(999) == (1000, 200)

    def test_bins_cover_every_value(self) -> None:
        """Equal-width bins span min to max; one bin when all values are equal."""
        bins = equal_bins([0.1, 0.2, 0.9, 1.3])
        assert bins[0][0] == 0.1
        assert bins[-1][1] == 1.3
        assert len(bins) == 5
        assert equal_bins([2.0, 2.0]) == [(2.0, 2.0)]
        assert equal_bins([]) == []

    def test_marker_labels_stay_inside_the_chart(self) -> None:
        """A marker at the right edge (p99 at the maximum) is labelled left of its line, so
        its label is not cut off; one with room is labelled right of its line."""
        svg = histogram(
            chart_id="c",
            title="latency",
            description="d",
            bins=[(0.0, 1.0), (1.0, 2.0)],
            counts=[(1.0,), (1.0,)],
            series=[Series(name="s", color="#000")],
            x_label="seconds",
            markers=[("p50", 1.0), ("p99", 2.0)],
        )
        lines = dict(re.findall(r'<title>(p\d+) [^<]*</title><line x1="([\d.]+)"', svg))
        labels = re.findall(r'<text x="([\d.]+)" y="[\d.]+" text-anchor="(\w+)">(p\d+)<', svg)
        assert {name: anchor for _, anchor, name in labels} == {"p50": "start", "p99": "end"}
        for x, anchor, name in labels:
            label_x, line_x, width = float(x), float(lines[name]), 7 * len(name)
            if anchor == "start":
                assert line_x < label_x
                assert label_x + width <= WIDTH
            else:
                assert label_x < line_x
                assert label_x - width >= 0

    def test_share_bar_describes_its_parts(self) -> None:
        """The share bar's description lists each non-empty part with its share."""
        from rollout_client.eval.report._markup import OUTCOME_SERIES

        svg = share_bar(
            chart_id="c",
            title="Items <by> outcome",
            parts=[(OUTCOME_SERIES["success"], 3), (OUTCOME_SERIES["failed"], 1)],
        )
        assert "success 3 (75%), failed 1 (25%)" in svg
        assert "Items &lt;by&gt; outcome" in svg


class TestFindRunDir:
    async def test_a_run_is_found_by_directory_or_by_name(self, fakes: Any, tmp_path: Path) -> None:
        """RUN may be the run directory or its name under --output; else a clear error."""
        run_dir = await make_run(fakes, tmp_path, {}, rows=1)
        assert find_run_dir(str(run_dir), tmp_path / "elsewhere") == run_dir
        assert find_run_dir("run", tmp_path / "out") == run_dir
        with pytest.raises(EvalInputError, match="no run 'nope'"):
            find_run_dir("nope", tmp_path / "out")
        with pytest.raises(EvalInputError, match=r"has no manifest\.json"):
            load_run(tmp_path)


class TestReportCommand:
    async def test_report_writes_the_file_and_prints_its_path(
        self, fakes: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """rollout-eval report NAME --output DIR writes report.html and prints its path."""
        run_dir = await make_run(fakes, tmp_path, {"1": "agent_error"}, rows=2)
        assert main(["report", "run", "--output", str(tmp_path / "out")]) == 0
        assert capsys.readouterr().out == f"{run_dir / 'report.html'}\n"
        assert "agent_error in row 1" in (run_dir / "report.html").read_text(encoding="utf-8")
        assert main(["report", "nope", "--output", str(tmp_path / "out")]) == 2
        assert "no run 'nope'" in capsys.readouterr().err

    def test_show_and_report_describe_themselves(self, capsys: pytest.CaptureFixture[str]) -> None:
        """The help of show and report says what each prints or writes."""
        for command, words in (("show", "failed items"), ("report", "self-contained page")):
            with pytest.raises(SystemExit) as exited:
                main([command, "--help"])
            assert exited.value.code == 0
            assert words in " ".join(capsys.readouterr().out.split())
