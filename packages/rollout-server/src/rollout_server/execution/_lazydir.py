"""``LazyDirectory``: a rollout's ``artifacts/`` directory, made when code first asks for it.

Most workflows never write an artifact, and on a journalling file system every directory
costs an inode (about a tenth of a millisecond of kernel time each on the benchmark
machine's ext4). So LocalBackend makes the rollout directory ``<artifact_root>/<id>/``
before the workflow runs (with osmosis-ai's three attempts) and ``artifacts/`` inside it
only when ``ctx.artifacts_dir`` is first read.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Final

from .._logtext import get_logger
from ._trajectory import make_directory

__all__ = ["LazyDirectory", "directory_repr", "resolve_directory"]

logger: Final = get_logger("rollout_server.local_backend")

_MAKING: Final = threading.Lock()
"""Held while a directory is made: one lock for all (a lock per rollout in flight would cost
memory; making a directory is rare and quick)."""


# Speed: benchmarks/README.md, "LocalBackend: files and copies", row "`artifacts/` made when
#   `ctx.artifacts_dir` is first read ..."
# Speed: benchmarks/README.md, "LocalBackend: files and copies", row "A rollout's directory kept as
#   a string, not a Path object ..."
# Speed: benchmarks/README.md, "Server: what a waiting rollout holds", row "Per-rollout objects have
#   `__slots__` ..."
class LazyDirectory:
    """A directory that is created the first time :meth:`get` is called.

    Args:
        path: The directory; its parent normally exists already (missing parents are made
            too).

    Thread-safe: workflow code may first ask from a worker thread.
    """

    __slots__ = ("_made", "_path")

    def __init__(self, path: str | os.PathLike[str]) -> None:
        # A string, not a Path: a Path object held per rollout in flight costs ~250 bytes.
        self._path = os.fspath(path)
        self._made: bool | None = None  # None: not tried yet; then whether it exists

    @property
    def path(self) -> Path:
        """The directory (made or not)."""
        return Path(self._path)

    def __repr__(self) -> str:
        state = {None: "not made yet", True: "made", False: "could not be made"}[self._made]
        return f"LazyDirectory({self._path!r}, {state})"

    @property
    def made(self) -> bool:
        """Whether the directory has been created (by :meth:`get`)."""
        return self._made is True

    def get(self) -> Path | None:
        """The directory, created on the first call; None when it cannot be created.

        Blocking on the first call (one ``mkdir``: microseconds on a local disk). A failure
        is logged once (WARNING) and not retried: the parent was made moments before, so
        what fails now (no space, no permission, a file in the way) does not go away.
        """
        made = self._made
        if made is None:
            with _MAKING:
                made = self._made
                if made is None:
                    made = self._made = self._make()
        return self.path if made else None

    def _make(self) -> bool:
        try:
            make_directory(self._path)
        except OSError as exc:
            logger.warning(
                "Cannot create the artifacts directory %s (%s); the rollout's code gets "
                "artifacts_dir=None",
                self._path,
                exc,
            )
            return False
        return True


def resolve_directory(value: Path | LazyDirectory | None) -> Path | None:
    """``value`` as a path: a :class:`LazyDirectory` is made (or found unmakeable) first."""
    if isinstance(value, LazyDirectory):
        return value.get()
    return value


def directory_repr(value: Path | LazyDirectory | None) -> str:
    """How a context's repr shows its artifacts directory: the path, whether made or not."""
    return repr(value.path if isinstance(value, LazyDirectory) else value)
