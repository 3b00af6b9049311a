"""The lazily made artifacts directory and the contexts that hand it out."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from rollout_server import GraderContext, WorkflowContext
from rollout_server.execution._lazydir import LazyDirectory, resolve_directory


class TestLazyDirectory:
    def test_made_on_first_get_only(self, tmp_path: Path) -> None:
        """Nothing is created until get(); then the directory exists and is returned."""
        lazy = LazyDirectory(tmp_path / "artifacts")
        assert not lazy.made
        assert not (tmp_path / "artifacts").exists()
        assert "not made yet" in repr(lazy)
        assert lazy.get() == tmp_path / "artifacts"
        assert (tmp_path / "artifacts").is_dir()
        assert lazy.made
        assert repr(lazy) == f"LazyDirectory({str(tmp_path / 'artifacts')!r}, made)"

    def test_one_mkdir_however_often_and_from_however_many_threads(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Concurrent first reads from several threads make the directory once; later
        reads make no system call."""
        calls: list[str] = []
        real_mkdir = os.mkdir

        def counting_mkdir(path: str | Path, mode: int = 0o777) -> None:
            calls.append(str(path))
            real_mkdir(path, mode)

        monkeypatch.setattr(os, "mkdir", counting_mkdir)
        lazy = LazyDirectory(tmp_path / "artifacts")
        start = threading.Barrier(8)
        results: list[Path | None] = []

        def read() -> None:
            start.wait(timeout=10)
            results.append(lazy.get())

        threads = [threading.Thread(target=read) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=10)
        assert results == [tmp_path / "artifacts"] * 8
        assert calls == [str(tmp_path / "artifacts")]

    def test_existing_directory_and_missing_parents(self, tmp_path: Path) -> None:
        """An existing directory is taken as is; missing parents are made."""
        (tmp_path / "there").mkdir()
        assert LazyDirectory(tmp_path / "there").get() == tmp_path / "there"
        deep = tmp_path / "a" / "b" / "artifacts"
        assert LazyDirectory(deep).get() == deep
        assert deep.is_dir()

    def test_failure_is_none_logged_once_and_not_retried(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A file in the way gives None with one WARNING naming the path, and stays None
        even once the obstacle is gone."""
        blocker = tmp_path / "artifacts"
        blocker.write_text("in the way")
        lazy = LazyDirectory(blocker)
        with caplog.at_level("WARNING", logger="rollout_server"):
            assert lazy.get() is None
            assert lazy.get() is None
        assert len(caplog.records) == 1
        assert str(blocker) in caplog.records[0].getMessage()
        assert "could not be made" in repr(lazy)
        blocker.unlink()
        assert lazy.get() is None
        assert not blocker.exists()


class TestContexts:
    @pytest.mark.parametrize("context_type", [WorkflowContext, GraderContext])
    def test_a_given_path_is_used_as_is(self, tmp_path: Path, context_type: type) -> None:
        """A path given by the caller (a test of user code, say) is returned unchanged and
        never created; the repr shows it."""
        path = tmp_path / "mine"
        if context_type is WorkflowContext:
            ctx = WorkflowContext(rollout_id="r", prompt=[], artifacts_dir=path)
        else:
            ctx = GraderContext(rollout_id="r", artifacts_dir=path)
        assert ctx.artifacts_dir == path
        assert not path.exists()
        assert repr(path) in repr(ctx)

    @pytest.mark.parametrize("context_type", [WorkflowContext, GraderContext])
    def test_a_lazy_directory_is_made_on_read(self, tmp_path: Path, context_type: type) -> None:
        """Given a LazyDirectory, the context makes it when the attribute is first read;
        the repr shows the path without making it."""
        lazy = LazyDirectory(tmp_path / "artifacts")
        if context_type is WorkflowContext:
            ctx = WorkflowContext(rollout_id="r", prompt=[], artifacts_dir=lazy)
        else:
            ctx = GraderContext(rollout_id="r", artifacts_dir=lazy)
        assert repr(tmp_path / "artifacts") in repr(ctx)
        assert not lazy.made
        assert ctx.artifacts_dir == tmp_path / "artifacts"
        assert lazy.made

    def test_resolve_directory(self, tmp_path: Path) -> None:
        """None and paths pass through; a LazyDirectory becomes its (made) path."""
        assert resolve_directory(None) is None
        assert resolve_directory(tmp_path) == tmp_path
        assert resolve_directory(LazyDirectory(tmp_path / "x")) == tmp_path / "x"
