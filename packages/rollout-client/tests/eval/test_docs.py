"""The client README documents the files of a run field by field, as they are written."""

from __future__ import annotations

import asyncio
import io
import json
import re
from pathlib import Path
from typing import Any

from rollout_client.eval import EvalOptions, run_eval

README = Path(__file__).resolve().parents[2] / "README.md"


def documented(file_name: str) -> list[str]:
    """The field names (first column, in backticks) of the table under ``#### `file_name```."""
    text = README.read_text(encoding="utf-8")
    section = text.split(f"#### `{file_name}`\n", 1)[1].split("\n#", 1)[0]
    return re.findall(r"^\| `([^`]+)` \|", section, flags=re.MULTILINE)


def first_line(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8").splitlines()[0])
    return data


class TestRunFilesDocumentation:
    async def test_every_field_written_is_documented_and_no_other(
        self, fakes: Any, dataset: Path, tmp_path: Path
    ) -> None:
        """The README's tables of events.jsonl and samples.jsonl list exactly the keys of
        their lines, and its summary.json table every top-level key and only real paths."""

        async def succeed(request: dict[str, Any], _cancelled: asyncio.Event) -> Any:
            return fakes.success(request["rollout_id"], 1.0)

        server = fakes.FakeServer(succeed)
        report = await run_eval(
            EvalOptions(
                dataset=dataset,
                server_url="http://127.0.0.1:9",
                chat_url="http://127.0.0.1:9/v1",
                output=tmp_path / "out",
                progress="off",
                n=2,
            ),
            stream=io.StringIO(),
            client_factory=server.factory,
        )
        assert documented("events.jsonl") == list(first_line(report.run_dir / "events.jsonl"))
        assert documented("samples.jsonl") == list(first_line(report.run_dir / "samples.jsonl"))
        paths = documented("summary.json")
        summary = json.loads((report.run_dir / "summary.json").read_text(encoding="utf-8"))
        assert {path.split(".")[0] for path in paths} == set(summary)
        for path in paths:
            value: Any = summary
            for key in path.split("."):
                assert isinstance(value, dict), path
                assert key in value, path
                value = value[key]
