"""The run manifest: fingerprinted inputs and what may change between invocations."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rollout_client.eval import EvalInputError, ManifestMismatchError
from rollout_client.eval._manifest import (
    Manifest,
    RunInputs,
    compare_manifests,
    format_rows,
    read_manifest,
    write_manifest,
)


def manifest(**changes: object) -> Manifest:
    base = Manifest(
        inputs=RunInputs(
            dataset_sha256="a" * 64, rows="0-9", n=1, agent_timeout_sec=None, grader_timeout_sec=5.0
        ),
        chat_models=("m",),
        dataset_path="d.jsonl",
        server_url="http://s",
        chat_url="http://c/v1",
        created_at="t",
        tool_version="0.1.0",
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


class TestManifest:
    def test_round_trip(self, tmp_path: Path) -> None:
        """A written manifest reads back equal."""
        path = tmp_path / "manifest.json"
        write_manifest(path, manifest())
        assert read_manifest(path) == manifest()

    def test_changed_inputs_are_all_listed(self, tmp_path: Path) -> None:
        """Every changed fingerprinted input is named, with old and new values."""
        new = manifest(
            inputs=RunInputs(
                dataset_sha256="b" * 64,
                rows="0-4",
                n=2,
                agent_timeout_sec=3.0,
                grader_timeout_sec=5.0,
            ),
            chat_models=("other",),
        )
        with pytest.raises(ManifestMismatchError) as caught:
            compare_manifests(manifest(), new, run_dir=tmp_path)
        assert len(caught.value.changed) == 5
        text = str(caught.value)
        assert "selected rows (0-9 -> 0-4)" in text
        assert "--agent-timeout-sec (server default -> 3 s)" in text
        assert "models served at the chat URL (m -> other)" in text

    def test_moved_urls_only_warn(self, tmp_path: Path) -> None:
        """New server and chat URLs (fresh ports) are warnings, not a refusal."""
        warnings = compare_manifests(
            manifest(), manifest(server_url="http://s2", chat_url="http://c2/v1"), run_dir=tmp_path
        )
        assert len(warnings) == 2

    def test_corrupt_manifest_suggests_fresh(self, tmp_path: Path) -> None:
        """An unreadable manifest is an error that suggests --fresh."""
        path = tmp_path / "manifest.json"
        path.write_text("{")
        with pytest.raises(EvalInputError, match="--fresh"):
            read_manifest(path)

    def test_format_rows(self) -> None:
        """Row selections are written compactly."""
        assert format_rows([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
        assert format_rows([]) == ""
