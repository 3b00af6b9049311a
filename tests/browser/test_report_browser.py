"""The HTML report renders in a real browser: headless Chromium, no console errors, charts drawn.

Each test writes a report, loads it from its file in Chromium, and checks that the page
logged no error or warning and threw nothing, that the full-page screenshot is not blank
(many colours, a good share of non-background pixels), and that every chart's ``<svg>``
has a non-zero size. Screenshots are kept in ``ROLLOUT_SCREENSHOT_DIR`` when it is set.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from browser_harness import BrowserPage, image_stats

from rollout_client.eval import JournalRecord
from rollout_client.eval.report import write_report

ROOT = Path(__file__).resolve().parents[2]

SCRIPT_TEXT = '<script>window.__xss = 1; console.error("xss ran")</script>'
IMG_TEXT = '<img src="x" onerror="window.__xss = 2">'


def write_run(
    run_dir: Path,
    outcomes: list[tuple[str, float | None]],
    *,
    n: int = 1,
    messages: Any = None,
) -> Path:
    """Write a run directory: ``outcomes[i]`` is item i's (outcome, reward), row i // n."""
    run_dir.mkdir(parents=True)
    rows = len(outcomes) // n
    manifest = {
        "format": 1,
        "tool": "rollout-eval",
        "tool_version": "0.1.0",
        "created_at": "2026-12-03T12:00:00+00:00",
        "fingerprint": "0" * 64,
        "inputs": {
            "dataset_sha256": "a" * 64,
            "rows": f"0-{rows - 1}" if rows else "",
            "n": n,
            "agent_timeout_sec": None,
            "grader_timeout_sec": None,
        },
        "chat_models": ["test-model"],
        "context": {
            "dataset_path": "data/questions.jsonl",
            "server_url": "http://127.0.0.1:8100",
            "chat_url": "http://127.0.0.1:8000/v1",
        },
    }
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    events, samples = [], []
    for index, (outcome, reward) in enumerate(outcomes):
        category = {"failed": "agent_error", "infra_failure": "lease_expired"}.get(outcome)
        record = JournalRecord(
            row_index=index // n,
            run_index=index % n,
            rollout_id=f"r{index}",
            status="success" if outcome in ("success", "skipped") else "failure",
            reward=reward,
            err_category=category,
            err_message=f"{category} {IMG_TEXT} on attempt {index % 3}" if category else None,
            outcome=outcome,
            latency_sec=0.05 + (index % 17) * 0.03,
        )
        events.append(json.dumps(record.as_json()))
        if outcome != "infra_failure":
            conversation = messages or [
                {"role": "system", "content": "You are a calculator."},
                {"role": "user", "content": f"What is {index} + 1? {SCRIPT_TEXT}"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "calculator", "arguments": '{"x": "1+1"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": '{"result": 2}'},
                {"role": "assistant", "content": f"The answer is {index + 1}. {IMG_TEXT}"},
            ]
            samples.append(
                json.dumps(
                    {
                        "row_index": index // n,
                        "run_index": index % n,
                        "rollout_id": f"r{index}",
                        "outcome": outcome,
                        "reward": reward,
                        "remove_sample": outcome == "skipped",
                        "messages": conversation,
                        "metrics": {"turns": 2},
                    }
                )
            )
    (run_dir / "events.jsonl").write_text("".join(line + "\n" for line in events))
    (run_dir / "samples.jsonl").write_text("".join(line + "\n" for line in samples))
    return run_dir


def mixed_outcomes(count: int) -> list[tuple[str, float | None]]:
    """Mostly passing successes, with partial rewards, failures, skips and infra failures."""
    cycle: list[tuple[str, float | None]] = [
        ("success", 1.0),
        ("success", 1.0),
        ("success", 0.5),
        ("failed", None),
        ("success", 1.0),
        ("skipped", None),
        ("success", 0.25),
        ("infra_failure", None),
    ]
    return [cycle[i % len(cycle)] for i in range(count)]


async def check_renders(page: BrowserPage, report: Path, shots: Path, name: str) -> None:
    """Load ``report``; assert no console errors, a non-blank screenshot, sized charts."""
    await page.load(report.as_uri())
    assert page.errors == []
    sizes = await page.evaluate(
        "Array.from(document.querySelectorAll('svg')).map(function (s) {"
        " var r = s.getBoundingClientRect(); return [r.width, r.height]; })"
    )
    assert all(width > 0 and height > 0 for width, height in sizes), sizes
    png = await page.screenshot(full_page=True)
    (shots / f"{name}.png").write_bytes(png)
    (shots / f"{name}-viewport.png").write_bytes(await page.screenshot(full_page=False))
    stats = image_stats(png)
    assert stats.colors >= 16, stats
    assert stats.foreground >= 0.05, stats
    assert page.errors == []


@pytest.fixture
def demo_report(tmp_path: Path) -> Path:
    """Run the demo (--n 2, 30% wrong answers) with --report; return the report it printed."""
    completed = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "demo.py"),
            "--output",
            str(tmp_path),
            "--n",
            "2",
            "--error-rate",
            "0.3",
            "--latency-ms",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    report = tmp_path / "demo" / "report.html"
    assert f"demo: report (open it in a browser): {report}" in completed.stdout
    return report


class TestReportInChromium:
    async def test_demo_report_renders_with_every_chart(
        self, page: BrowserPage, demo_report: Path, screenshot_dir: Path
    ) -> None:
        """The demo's own report renders with its four charts, pass@k among them."""
        await check_renders(page, demo_report, screenshot_dir, "demo-report")
        charts = await page.evaluate("document.querySelectorAll('svg[role=img]').length")
        assert charts == 4  # outcomes, rewards, latency, pass@k

    async def test_markup_in_messages_is_shown_as_text(
        self, page: BrowserPage, tmp_path: Path, screenshot_dir: Path
    ) -> None:
        """A <script> or <img onerror> in a message or error is shown as text, never run."""
        run_dir = write_run(tmp_path / "run", mixed_outcomes(24), n=3)
        await check_renders(page, write_report(run_dir), screenshot_dir, "mixed-report")
        assert await page.evaluate("window.__xss === undefined") is True
        assert await page.evaluate("document.scripts.length") == 1
        assert await page.evaluate("document.querySelectorAll('img').length") == 0
        await page.evaluate("document.querySelectorAll('details').forEach(d => d.open = true)")
        text = await page.evaluate("document.body.innerText")
        assert SCRIPT_TEXT in text
        assert IMG_TEXT in text

    async def test_item_link_opens_its_conversation_and_the_filter_hides_rows(
        self, page: BrowserPage, tmp_path: Path
    ) -> None:
        """Following an item's link opens its conversation; the outcome filter hides rows."""
        run_dir = write_run(tmp_path / "run", mixed_outcomes(8))
        report = write_report(run_dir)
        await page.load(report.as_uri())
        assert await page.evaluate("document.getElementById('item-3-0').open") is False
        await page.evaluate("document.querySelector('a[href=\"#item-3-0\"]').click()")
        assert await page.evaluate("document.getElementById('item-3-0').open") is True
        visible = await page.evaluate(
            "var f = document.getElementById('outcome-filter'); f.value = 'failures';"
            "f.dispatchEvent(new Event('change'));"
            "Array.from(document.querySelectorAll('#items-table tbody tr'))"
            ".filter(function (r) { return !r.hidden; }).map(function (r) { return r.id; })"
        )
        assert visible == ["row-3-0", "row-7-0"]
        assert page.errors == []

    @pytest.mark.parametrize(
        ("name", "outcomes", "n"),
        [
            ("empty-report", [], 1),
            ("all-failures-report", [("failed", None), ("infra_failure", None)] * 3, 2),
            ("single-report", [("success", None)], 1),
        ],
    )
    async def test_edge_runs_render(
        self,
        page: BrowserPage,
        tmp_path: Path,
        screenshot_dir: Path,
        name: str,
        outcomes: list[tuple[str, float | None]],
        n: int,
    ) -> None:
        """A run with no items, with only failures, or one item without a reward renders."""
        run_dir = write_run(tmp_path / "run", outcomes, n=n)
        await check_renders(page, write_report(run_dir), screenshot_dir, name)

    async def test_huge_conversations_render_cut(
        self, page: BrowserPage, tmp_path: Path, screenshot_dir: Path
    ) -> None:
        """Conversations of megabytes render cut, with a note, in a report of bounded size."""
        huge = [{"role": "user", "content": "question"}] + [
            {"role": "assistant" if i % 2 else "tool", "content": "x" * 200_000} for i in range(40)
        ]
        run_dir = write_run(tmp_path / "run", mixed_outcomes(6), messages=huge)
        report = write_report(run_dir)
        assert report.stat().st_size < 1_000_000
        await check_renders(page, report, screenshot_dir, "huge-report")
        text = await page.evaluate("document.body.textContent")
        assert "messages not shown here" in text
