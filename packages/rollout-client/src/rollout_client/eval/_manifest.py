"""The run manifest (``manifest.json``): a fingerprint of the inputs that decide the results.

Resuming a run is refused when its results would mix two different experiments. The
fingerprinted inputs are the dataset's bytes (SHA-256), the selected rows, ``n``, and the
agent and grader timeouts. The models the chat endpoint serves (read from
``GET {chat_url}/models`` when it answers) are compared too, since a different model is a
different experiment. The server URL and the chat URL are *not* fingerprinted: servers and
ports move (the demo picks free ports each time) while the model stays the same; a
changed URL only produces a warning. The pass threshold is a reporting parameter and can
change freely.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from ._errors import EvalInputError, ManifestMismatchError

__all__ = [
    "MANIFEST_FORMAT",
    "Manifest",
    "RunInputs",
    "compare_manifests",
    "format_rows",
    "read_manifest",
    "write_manifest",
]

MANIFEST_FORMAT: Final = 1
"""Version of the ``manifest.json`` layout."""


def format_rows(indices: Sequence[int]) -> str:
    """Write sorted row positions compactly: ``[0, 1, 2, 5]`` becomes ``"0-2,5"``."""
    parts: list[str] = []
    start = prev = None
    for index in indices:
        if start is None or prev is None:
            start = prev = index
        elif index == prev + 1:
            prev = index
        else:
            parts.append(f"{start}-{prev}" if prev != start else str(start))
            start = prev = index
    if start is not None and prev is not None:
        parts.append(f"{start}-{prev}" if prev != start else str(start))
    return ",".join(parts)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RunInputs:
    """The inputs a run's results depend on; :attr:`fingerprint` hashes them.

    ``rows`` is the selection in :func:`format_rows` form; timeouts are float seconds or
    ``None`` (the server's default).
    """

    dataset_sha256: str
    rows: str
    n: int
    agent_timeout_sec: float | None
    grader_timeout_sec: float | None

    def as_json(self) -> dict[str, Any]:
        """The inputs as a JSON object (the ``inputs`` key of the manifest)."""
        return dataclasses.asdict(self)

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the canonical JSON of the inputs."""
        canonical = json.dumps(self.as_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Manifest:
    """What ``manifest.json`` holds: the fingerprinted inputs plus context for humans.

    ``chat_models`` is the sorted list of model ids the chat endpoint reported, or
    ``None`` when it could not be read.
    """

    inputs: RunInputs
    chat_models: tuple[str, ...] | None
    dataset_path: str
    server_url: str
    chat_url: str
    created_at: str
    tool_version: str

    def as_json(self) -> dict[str, Any]:
        """The manifest document."""
        return {
            "format": MANIFEST_FORMAT,
            "tool": "rollout-eval",
            "tool_version": self.tool_version,
            "created_at": self.created_at,
            "fingerprint": self.inputs.fingerprint,
            "inputs": self.inputs.as_json(),
            "chat_models": list(self.chat_models) if self.chat_models is not None else None,
            "context": {
                "dataset_path": self.dataset_path,
                "server_url": self.server_url,
                "chat_url": self.chat_url,
            },
        }


def write_manifest(path: Path, manifest: Manifest) -> None:
    """Write ``manifest.json`` atomically (temporary file, fsync, rename)."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as file:
        json.dump(manifest.as_json(), file, indent=2, sort_keys=True)
        file.write("\n")
        file.flush()
        os.fsync(file.fileno())
    tmp.replace(path)


def _corrupt(path: Path, why: str) -> EvalInputError:
    return EvalInputError(
        f"{path} is not a valid rollout-eval manifest ({why}); re-run with --fresh to archive "
        "this run and start over"
    )


def read_manifest(path: Path) -> Manifest:
    """Read ``manifest.json``.

    Raises:
        EvalInputError: If it is not a manifest this version can read (the message
            suggests ``--fresh``).
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _corrupt(path, str(exc)) from None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise _corrupt(path, f"expected format {MANIFEST_FORMAT}")
    try:
        raw = data["inputs"]
        inputs = RunInputs(
            dataset_sha256=str(raw["dataset_sha256"]),
            rows=str(raw["rows"]),
            n=int(raw["n"]),
            agent_timeout_sec=_optional_float(raw["agent_timeout_sec"]),
            grader_timeout_sec=_optional_float(raw["grader_timeout_sec"]),
        )
        models = data.get("chat_models")
        context = data.get("context") or {}
        return Manifest(
            inputs=inputs,
            chat_models=tuple(str(m) for m in models) if isinstance(models, list) else None,
            dataset_path=str(context.get("dataset_path", "")),
            server_url=str(context.get("server_url", "")),
            chat_url=str(context.get("chat_url", "")),
            created_at=str(data.get("created_at", "")),
            tool_version=str(data.get("tool_version", "")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise _corrupt(path, f"missing or bad field: {exc}") from None


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _timeout_text(value: float | None) -> str:
    return "server default" if value is None else f"{value:g} s"


def _short(digest: str) -> str:
    return digest[:12] + "…"


def compare_manifests(old: Manifest, new: Manifest, *, run_dir: Path) -> list[str]:
    """Check that ``new`` may continue the run recorded by ``old``.

    Returns:
        Warnings about context that changed harmlessly (server or chat URL, dataset path).

    Raises:
        ManifestMismatchError: Listing every fingerprinted input that changed, and how to
            start over (``--fresh``) or keep both runs (``--name``).
    """
    changed: list[str] = []
    a, b = old.inputs, new.inputs
    if a.dataset_sha256 != b.dataset_sha256:
        changed.append(
            f"dataset content (sha256 {_short(a.dataset_sha256)} -> {_short(b.dataset_sha256)})"
        )
    if a.rows != b.rows:
        changed.append(f"selected rows ({a.rows} -> {b.rows})")
    if a.n != b.n:
        changed.append(f"--n ({a.n} -> {b.n})")
    if a.agent_timeout_sec != b.agent_timeout_sec:
        changed.append(
            f"--agent-timeout-sec ({_timeout_text(a.agent_timeout_sec)} -> "
            f"{_timeout_text(b.agent_timeout_sec)})"
        )
    if a.grader_timeout_sec != b.grader_timeout_sec:
        changed.append(
            f"--grader-timeout-sec ({_timeout_text(a.grader_timeout_sec)} -> "
            f"{_timeout_text(b.grader_timeout_sec)})"
        )
    if (
        old.chat_models is not None
        and new.chat_models is not None
        and old.chat_models != new.chat_models
    ):
        changed.append(
            f"models served at the chat URL ({', '.join(old.chat_models) or 'none'} -> "
            f"{', '.join(new.chat_models) or 'none'})"
        )
    if changed:
        raise ManifestMismatchError(
            f"cannot resume the run in {run_dir}: it was started with different inputs:\n"
            + "".join(f"  - {item}\n" for item in changed)
            + "Re-run with --fresh to archive that run and start over, or pass --name NEW "
            "to keep it and start a separate run.",
            changed,
        )
    warnings: list[str] = []
    if old.server_url != new.server_url:
        warnings.append(f"the rollout server URL changed ({old.server_url} -> {new.server_url})")
    if old.chat_url != new.chat_url:
        warnings.append(f"the chat URL changed ({old.chat_url} -> {new.chat_url})")
    if (old.chat_models is None or new.chat_models is None) and old.chat_url != new.chat_url:
        warnings.append(
            "the chat endpoint's models could not be compared; make sure it serves the same model"
        )
    return warnings
