"""A rollout's files: what they say, and where and how they are written.

The module has two halves with one seam between them. *What the documents say*:
:class:`RolloutFacts` (everything a finished rollout's files are built from),
:func:`trajectory_document` (the facts fed to the ATIF builder,
:func:`rollout_server.execution._atif.build_trajectory`) and :func:`diagnostics_document`.
*Where and how they are written*: the layout and artifact root below, :func:`encode_document` and
:func:`write_json_atomic` (any document), and :class:`RolloutFiles`, which makes each
rollout's directory and writes its documents through a
:class:`~rollout_server.execution._offload.BatchOffloader`. A new document format (or a new
document) changes the first half only.

Layout, per rollout, under the artifact root::

    <artifact_root>/<rollout_id>/artifacts/        files the workflow and grader keep (made
                                                   when ``ctx.artifacts_dir`` is first read)
    <artifact_root>/<rollout_id>/trajectory.json   the conversation as an ATIF document (format
                                                   in :mod:`rollout_server.execution._atif`), when
                                                   there is one
    <artifact_root>/<rollout_id>/diagnostics.json  backend diagnostics (tracebacks), if any

The artifact root is, in order: the backend's ``artifact_root`` argument,
``$ROLLOUT_ARTIFACT_ROOT``, ``$_OSMOSIS_ROLLOUT_ARTIFACT_ROOT`` (osmosis-ai's variable), then
``$XDG_STATE_HOME/rollout/artifacts`` or ``~/.local/state/rollout/artifacts``.

Files are compact JSON (UTF-8, one line). Values JSON cannot hold (NaN, objects) are dropped
with :func:`fit_json` when a file is encoded (:func:`encode_document`), and a
WARNING lists them.
Files are written atomically (a temporary file in the same directory, then a rename), so a
reader never sees half a file. Each write's time (and failure) goes to the request's
observer, and, when the server traces, the write is a ``trajectory write`` span.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import attrs

from rollout_types import RolloutTurn, is_single_path_segment

from .._logtext import get_logger
from .._sanitize import fit_json
from ..observability import _tracing
from ..observability._jsonlog import log_fields
from ._atif import build_trajectory
from ._backend import ExecutionOutcome, ExecutionRequest, ExecutionResult
from ._offload import BatchOffloader

__all__ = [
    "ARTIFACTS_DIR_NAME",
    "ARTIFACTS_DIR_RETRY_DELAYS_SEC",
    "ARTIFACT_ROOT_ENV",
    "DIAGNOSTICS_FILE_NAME",
    "FILE_JOB_TIMEOUT_SEC",
    "OSMOSIS_ARTIFACT_ROOT_ENV",
    "TRAJECTORY_FILE_NAME",
    "RolloutFacts",
    "RolloutFiles",
    "default_artifact_root",
    "diagnostics_document",
    "encode_document",
    "make_directory",
    "trajectory_document",
    "write_json_atomic",
    "write_rollout_files",
]

logger: Final = get_logger("rollout_server.trajectory")
# What RolloutFiles logs about one rollout keeps the logger it had inside LocalBackend.
rollout_logger: Final = get_logger("rollout_server.local_backend")

ARTIFACT_ROOT_ENV: Final = "ROLLOUT_ARTIFACT_ROOT"
"""Environment variable naming the artifact root."""

OSMOSIS_ARTIFACT_ROOT_ENV: Final = "_OSMOSIS_ROLLOUT_ARTIFACT_ROOT"
"""osmosis-ai's artifact root variable, read when :data:`ARTIFACT_ROOT_ENV` is unset."""

ARTIFACTS_DIR_NAME: Final = "artifacts"
TRAJECTORY_FILE_NAME: Final = "trajectory.json"
DIAGNOSTICS_FILE_NAME: Final = "diagnostics.json"

ARTIFACTS_DIR_RETRY_DELAYS_SEC: Final = (0.5, 1.0)
"""Pauses between the 3 attempts to create a rollout's directory (as osmosis-ai does for its
artifacts directory)."""

FILE_JOB_TIMEOUT_SEC: Final = 10.0
"""Longest a rollout waits for one of its file jobs (its directory, its trajectory) when
they run in a worker thread (a slow file system); the job goes on after."""


# -- What the documents say -------------------------------------------------------------


@attrs.frozen(kw_only=True)
class RolloutFacts:
    """Everything a finished rollout's files are built from.

    Attributes:
        request: The rollout's request.
        outcome: What :meth:`~rollout_server.ExecutionBackend.execute` returned (or had
            when it was cancelled).
        reported: The result the caller is told; None means ``outcome.reported()``.
        timings: ``queued_sec``, ``workflow_sec``, ``grader_sec``, ``total_sec``.
        workflow_info: ``AgentWorkflowOutput.info``.
        turns: The model calls the server's gateway captured, in order (none without one).
    """

    request: ExecutionRequest
    outcome: ExecutionOutcome
    reported: ExecutionResult | None = None
    timings: Mapping[str, float | None]
    workflow_info: Mapping[str, Any] = attrs.field(factory=dict)
    turns: Sequence[RolloutTurn] = ()


def trajectory_document(facts: RolloutFacts) -> dict[str, Any] | None:
    """The ``trajectory.json`` document of a rollout: its ATIF trajectory
    (:func:`rollout_server.execution._atif.build_trajectory`) of the saved sample, the grader's when
    it has one, else the workflow's.

    Returns:
        The document, or None when there is no conversation to save.
    """
    outcome = facts.outcome
    grader = outcome.grader
    saved = grader if grader is not None and grader.sample is not None else outcome.workflow
    return build_trajectory(
        request=facts.request,
        reported=outcome.reported() if facts.reported is None else facts.reported,
        sample=saved.sample,
        workflow=outcome.workflow,
        grader=grader,
        timings=facts.timings,
        workflow_info=facts.workflow_info,
        turns=facts.turns,
    )


def diagnostics_document(facts: RolloutFacts) -> dict[str, Any] | None:
    """The ``diagnostics.json`` document: the phases' diagnostics (``extra_fields``, such
    as ``workflow_error`` with its traceback) merged; None when there are none."""
    diagnostics: dict[str, Any] = {}
    for result in (facts.outcome.workflow, facts.outcome.grader):
        if result is not None and result.extra_fields:
            diagnostics.update(result.extra_fields)
    return diagnostics or None


# -- Where and how they are written -------------------------------------------------------


def default_artifact_root(environ: Mapping[str, str] | None = None) -> Path:
    """The artifact root when the backend is given none (see the module docstring).

    Args:
        environ: The environment to read; default ``os.environ``.

    Returns:
        An absolute path (not created).
    """
    env = os.environ if environ is None else environ
    for name in (ARTIFACT_ROOT_ENV, OSMOSIS_ARTIFACT_ROOT_ENV):
        value = env.get(name, "").strip()
        if value:
            return Path(value).expanduser().absolute()
    state_home = env.get("XDG_STATE_HOME", "").strip()
    if state_home and Path(state_home).is_absolute():  # XDG: relative values are ignored
        return Path(state_home) / "rollout" / "artifacts"
    return Path.home() / ".local" / "state" / "rollout" / "artifacts"


_TEMP_SEQUENCE: Final = itertools.count()
"""Numbers the temporary files of :func:`write_json_atomic` within this process."""

_TEMP_FLAGS: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)


def _create_temp(path: Path) -> tuple[int, str]:
    """Create a new temporary file (owner-only) next to ``path``; return its fd and name.

    The name is unique within the process (pid and a counter), so the common case is one
    ``open``; a leftover file of that name (another process once had this pid) falls back
    to :func:`tempfile.mkstemp`.
    """
    directory, base = os.path.split(os.fspath(path))  # cheaper than Path.parent and .name
    name = f"{directory}{os.sep}.{base}.{os.getpid()}.{next(_TEMP_SEQUENCE)}.tmp"
    try:
        return os.open(name, _TEMP_FLAGS, 0o600), name
    except FileExistsError:
        return tempfile.mkstemp(dir=directory, prefix=f".{base}.", suffix=".tmp")


# Speed: benchmarks/README.md, "LocalBackend: files and copies", row "`trajectory.json` as compact
#   JSON from the C encoder ..."
def encode_document(document: Any, name: str, owner: str = "") -> bytes:
    """``document`` as compact strict JSON in UTF-8, with a final newline.

    The document is encoded as it is when it can be (the json module's C encoder: the
    common case costs no walk in Python). Otherwise it is fitted with
    :func:`rollout_types.fit_json` first (NaN and infinities, values JSON has no type for,
    lone surrogates and non-string keys are dropped or converted) and what was dropped is
    logged as a WARNING.

    Args:
        document: The value to encode.
        name: Its name in the log line, such as ``"trajectory"``.
        owner: Who it belongs to in the log line, such as ``"rollout r-1"``; default none.
    """
    try:
        return _encode(document)
    except (TypeError, ValueError, RecursionError):
        fitted, dropped = fit_json(document, name)
        if dropped:
            logger.warning(
                "%s%s: dropped values JSON cannot hold: %s",
                name.capitalize(),
                f" of {owner}" if owner else "",
                ", ".join(dropped),
            )
        return _encode(fitted)


def _encode(document: Any) -> bytes:
    # Compact: without ``indent`` the json module encodes in C (several times faster).
    text = json.dumps(document, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.encode() + b"\n"


# Speed: benchmarks/README.md, "LocalBackend: files and copies", row "An atomic write costs one
#   `open` ..."
def write_json_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file, then a rename).

    Blocking: call it off the event loop. The file is readable by its owner only.

    Raises:
        OSError: When the directory is missing or not writable.
    """
    fd, tmp_name = _create_temp(path)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp_name, path)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except OSError:
            pass
        raise


def write_rollout_files(
    rollout_dir: Path, trajectory: Mapping[str, Any] | None, diagnostics: Mapping[str, Any] | None
) -> None:
    """Write ``trajectory.json`` (when ``trajectory`` is not None) and ``diagnostics.json``
    (when ``diagnostics`` is not empty) into ``rollout_dir``, each encoded with
    :func:`encode_document` and written atomically; the directory is created if needed.

    Blocking: call it off the event loop.

    Raises:
        OSError: When the directory cannot be created or written.
    """
    owner = f"rollout {rollout_dir.name}"
    files = []
    if trajectory is not None:
        files.append((TRAJECTORY_FILE_NAME, encode_document(trajectory, "trajectory", owner)))
    if diagnostics:
        files.append((DIAGNOSTICS_FILE_NAME, encode_document(diagnostics, "diagnostics", owner)))
    for name, data in files:
        try:
            write_json_atomic(rollout_dir / name, data)
        except FileNotFoundError:
            # The directory is usually there already (made before the workflow ran).
            rollout_dir.mkdir(parents=True, exist_ok=True)
            write_json_atomic(rollout_dir / name, data)


# Speed: benchmarks/README.md, "LocalBackend: files and copies", row "An atomic write costs one
#   `open` ..."
def make_directory(path: str | os.PathLike[str]) -> None:
    """Create the directory ``path`` and any missing parents; fine if it exists.

    Blocking. The common case, a new rollout directory under an existing root, costs one
    ``mkdir`` call; anything else falls back to :meth:`pathlib.Path.mkdir`.

    Raises:
        OSError: When the directory cannot be created (or a file is in the way).
    """
    try:
        os.mkdir(path)
    except OSError:
        Path(path).mkdir(parents=True, exist_ok=True)


def _write_files(rollout_dir: str, facts: RolloutFacts) -> None:
    """The file job of one rollout: build its documents and write them (blocking).

    Building walks the whole sample (JSON fitting), so it is part of the job (in a worker
    thread when jobs run there); nothing changes the sample meanwhile (the backend has
    finished with it).
    """
    write_rollout_files(Path(rollout_dir), trajectory_document(facts), diagnostics_document(facts))


class RolloutFiles:
    """The files of one backend's rollouts: each one's directory and documents.

    The blocking file work runs through a
    :class:`~rollout_server.execution._offload.BatchOffloader`:
    at the end of the event loop's turn while the file system is fast, in a worker thread
    (each wait bounded by :data:`FILE_JOB_TIMEOUT_SEC`) once it is slow.

    Args:
        root: The absolute artifact root.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._jobs = BatchOffloader(thread_timeout_sec=FILE_JOB_TIMEOUT_SEC)
        self._writes: set[asyncio.Future[None]] = set()

    def rollout_dir(self, rollout_id: str) -> str | None:
        """``<root>/<rollout_id>``, or None when the id is not a single path segment (such
        a rollout keeps no files). A string: a Path held per rollout costs ~250 bytes."""
        if not is_single_path_segment(rollout_id):
            return None
        return os.path.join(self.root, rollout_id)

    async def prepare(self, rollout_id: str) -> str | None:
        """Make the rollout's directory (3 attempts, as osmosis-ai makes its artifacts
        directory, pausing :data:`ARTIFACTS_DIR_RETRY_DELAYS_SEC`).

        Returns:
            The path of its ``artifacts/`` directory (not made: user code makes it when it
            first asks, see
            :class:`~rollout_server.execution._lazydir.LazyDirectory`); None when the
            id keeps no files or the directory cannot be made (a WARNING says why).
        """
        path = self.rollout_dir(rollout_id)
        if path is None:
            rollout_logger.warning(
                "Rollout %r: the id is not a single path segment; no artifacts directory or "
                "trajectory is kept for it",
                rollout_id,
            )
            return None
        delays = (*ARTIFACTS_DIR_RETRY_DELAYS_SEC, None)
        for attempt, delay in enumerate(delays, start=1):
            try:
                await self._jobs.submit(functools.partial(make_directory, path))
            except OSError as exc:
                if delay is None:
                    rollout_logger.warning(
                        "Rollout %s: cannot create %s after %d attempts (%s); the workflow "
                        "gets artifacts_dir=None",
                        rollout_id,
                        path,
                        attempt,
                        exc,
                    )
                    return None
                await asyncio.sleep(delay)
            else:
                return os.path.join(path, ARTIFACTS_DIR_NAME)
        return None  # pragma: no cover - the loop always returns

    def save_soon(self, facts: RolloutFacts) -> asyncio.Future[None] | None:
        """Start writing the rollout's ``trajectory.json`` (when it has a conversation) and
        ``diagnostics.json`` (when it has diagnostics).

        A failure is logged (WARNING), never raised to the rollout. :meth:`wait_for_writes`
        waits for the write.

        Returns:
            The write's future (bounded: it fails with TimeoutError after
            :data:`FILE_JOB_TIMEOUT_SEC` in a worker thread), or None when the id keeps
            no files.
        """
        request = facts.request
        rollout_dir = self.rollout_dir(request.id)
        if rollout_dir is None:
            return None
        span = _tracing.start_span("trajectory write", request.id)
        write = self._jobs.submit(functools.partial(_write_files, rollout_dir, facts))
        write.add_done_callback(
            functools.partial(_write_done, request, rollout_dir, time.monotonic(), span)
        )
        self._writes.add(write)
        write.add_done_callback(self._writes.discard)
        return write

    async def save(self, facts: RolloutFacts) -> None:
        """Write the rollout's files and wait for the write (see :meth:`save_soon`);
        never raises but CancelledError, and cancelling the wait does not stop the write."""
        write = self.save_soon(facts)
        if write is not None:
            with contextlib.suppress(Exception):  # _write_done reports it
                await asyncio.shield(write)

    async def wait_for_writes(self, timeout_sec: float) -> None:
        """Wait up to ``timeout_sec`` seconds for the writes still in flight; stop waiting
        for the rest (a write already running in a thread goes on)."""
        pending = [write for write in self._writes if not write.done()]
        if pending:
            _done, still = await asyncio.wait(pending, timeout=timeout_sec)
            for write in still:
                write.cancel()


def _write_done(
    request: ExecutionRequest,
    rollout_dir: str,
    started: float,
    span: Any,
    write: asyncio.Future[None],
) -> None:
    """Report a finished write: timed (``request.observer``), traced, and logged when it
    failed."""
    exc: BaseException | None
    exc = asyncio.CancelledError() if write.cancelled() else write.exception()
    request.observer.observe_trajectory_write(time.monotonic() - started, failed=exc is not None)
    _tracing.end_span(span, exc)
    if write.cancelled():
        return
    if exc is not None:
        rollout_logger.warning(
            "Rollout %s: cannot save the trajectory: %s",
            request.id,
            exc,
            extra=log_fields(request.id),
        )
    elif rollout_logger.isEnabledFor(logging.DEBUG):
        # DEBUG, not INFO: a line per rollout on the hot path (the server's own "finished"
        # line already says the rollout is done).
        # Speed: benchmarks/README.md, "Server: the `rollout-server serve` process", row "The log
        #   lines of one loop turn written with one `write` ..."
        rollout_logger.debug("Rollout %s: trajectory saved in %s", request.id, rollout_dir)
