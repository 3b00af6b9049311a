"""The run directory ``OUTPUT/NAME/``: its files, and opening, creating or archiving it.

The directory holds :data:`MANIFEST_FILE` (the inputs' fingerprint: resuming with other
inputs is refused), :data:`JOURNAL_FILE` (the resume authority), :data:`SAMPLES_FILE` and
:data:`SUMMARY_FILE`.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Final, TextIO

from .. import __version__
from ._dataset import Dataset
from ._errors import EvalInputError, RunStateError
from ._journal import Journal, utc_now
from ._manifest import (
    Manifest,
    RunInputs,
    compare_manifests,
    format_rows,
    read_manifest,
    write_manifest,
)
from ._options import EvalOptions

__all__ = [
    "JOURNAL_FILE",
    "MANIFEST_FILE",
    "SAMPLES_FILE",
    "SUMMARY_FILE",
    "prepare_run_dir",
    "run_manifest",
]

MANIFEST_FILE: Final = "manifest.json"
JOURNAL_FILE: Final = "events.jsonl"
SAMPLES_FILE: Final = "samples.jsonl"
SUMMARY_FILE: Final = "summary.json"


def run_manifest(
    options: EvalOptions,
    dataset: Dataset,
    selected: tuple[int, ...],
    chat_models: tuple[str, ...] | None,
) -> Manifest:
    """The manifest of a run of ``options`` over the ``selected`` rows of ``dataset``."""
    return Manifest(
        inputs=RunInputs(
            dataset_sha256=dataset.sha256,
            rows=format_rows(selected),
            n=options.n,
            agent_timeout_sec=options.agent_timeout_sec,
            grader_timeout_sec=options.grader_timeout_sec,
        ),
        chat_models=chat_models,
        dataset_path=str(options.dataset),
        server_url=options.server_url,
        chat_url=options.chat_url,
        created_at=utc_now(),
        tool_version=__version__,
    )


def prepare_run_dir(
    options: EvalOptions, manifest: Manifest, progress_stream: TextIO
) -> tuple[Path, list[str]]:
    """Open the run directory for ``options.mode``: create it, resume it or archive it.

    Returns:
        The run directory and warnings about harmless input changes (resuming).

    Raises:
        RunStateError: ``resume`` without a run, or a journal without a manifest.
        ManifestMismatchError: The run exists with other inputs.
        EvalInputError: The directory cannot be created.
        JournalError: Another process holds the run being archived.
    """
    run_dir = options.output / options.run_name
    manifest_path = run_dir / MANIFEST_FILE
    warnings: list[str] = []
    exists = manifest_path.exists() or (run_dir / JOURNAL_FILE).exists()
    if options.mode == "resume" and not exists:
        raise RunStateError(
            f"--resume: there is no run {options.run_name!r} in {options.output} to resume; "
            "drop --resume to start it"
        )
    if exists and options.mode == "fresh":
        archived = _archive(run_dir)
        progress_stream.write(f"rollout-eval: archived the previous run to {archived}\n")
        exists = False
    if exists:
        if not manifest_path.exists():
            raise RunStateError(
                f"{run_dir} has a journal but no manifest.json; re-run with --fresh to archive "
                "it and start over"
            )
        warnings = compare_manifests(read_manifest(manifest_path), manifest, run_dir=run_dir)
    else:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise EvalInputError(f"cannot create the run directory {run_dir}: {exc}") from None
        write_manifest(manifest_path, manifest)
    return run_dir, warnings


def _archive(run_dir: Path) -> Path:
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    target = run_dir.with_name(f"{run_dir.name}.archived-{stamp}")
    suffix = 1
    while target.exists():
        suffix += 1
        target = run_dir.with_name(f"{run_dir.name}.archived-{stamp}-{suffix}")
    with Journal(run_dir / JOURNAL_FILE):  # refuses while another process runs it
        pass
    run_dir.rename(target)
    return target
