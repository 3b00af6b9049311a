"""Where a rollout's files live, and how they are written.

Layout, per rollout, under the artifact root::

    <artifact_root>/<rollout_id>/artifacts/        files the workflow and grader keep (made
                                                   when ``ctx.artifacts_dir`` is first read)
    <artifact_root>/<rollout_id>/trajectory.json   the conversation as an ATIF document (format
                                                   in :mod:`rollout_server._atif`), when
                                                   there is one
    <artifact_root>/<rollout_id>/diagnostics.json  backend diagnostics (tracebacks), if any

The artifact root is, in order: the backend's ``artifact_root`` argument,
``$ROLLOUT_ARTIFACT_ROOT``, ``$_OSMOSIS_ROLLOUT_ARTIFACT_ROOT`` (osmosis-ai's variable), then
``$XDG_STATE_HOME/rollout/artifacts`` or ``~/.local/state/rollout/artifacts``.

Files are compact JSON (UTF-8, one line). Values JSON cannot hold (NaN, objects) are dropped
with :func:`fit_json` when a file is encoded (:func:`encode_document`), and a
WARNING lists them.
Files are written atomically (a temporary file in the same directory, then a rename), so a
reader never sees half a file.
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from ._logtext import get_logger
from ._sanitize import fit_json

__all__ = [
    "ARTIFACTS_DIR_NAME",
    "ARTIFACT_ROOT_ENV",
    "DIAGNOSTICS_FILE_NAME",
    "OSMOSIS_ARTIFACT_ROOT_ENV",
    "TRAJECTORY_FILE_NAME",
    "default_artifact_root",
    "encode_document",
    "make_directory",
    "write_json_atomic",
    "write_rollout_files",
]

logger: Final = get_logger("rollout_server.trajectory")

ARTIFACT_ROOT_ENV: Final = "ROLLOUT_ARTIFACT_ROOT"
"""Environment variable naming the artifact root."""

OSMOSIS_ARTIFACT_ROOT_ENV: Final = "_OSMOSIS_ROLLOUT_ARTIFACT_ROOT"
"""osmosis-ai's artifact root variable, read when :data:`ARTIFACT_ROOT_ENV` is unset."""

ARTIFACTS_DIR_NAME: Final = "artifacts"
TRAJECTORY_FILE_NAME: Final = "trajectory.json"
DIAGNOSTICS_FILE_NAME: Final = "diagnostics.json"


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


def encode_document(document: Any, name: str, owner: str = "") -> bytes:
    """``document`` as compact strict JSON in UTF-8, with a final newline.

    The document is encoded as it is when it can be (the json module's C encoder: the
    common case costs no walk in Python). Otherwise it is fitted with
    :func:`fit_json` first (NaN and infinities, values JSON has no type for,
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
