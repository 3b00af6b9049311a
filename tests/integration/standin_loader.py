"""The chat stand-in (``tools/chat_standin/server.py``) imported as a module, once per process,
for tests that run it in their own event loop."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["load_standin"]

ROOT = Path(__file__).resolve().parents[2]
NAME = "chat_standin_server"


def load_standin() -> ModuleType:
    """Import ``tools/chat_standin/server.py`` (once: later calls return the same module)."""
    if NAME in sys.modules:
        return sys.modules[NAME]
    spec = importlib.util.spec_from_file_location(
        NAME, ROOT / "tools" / "chat_standin" / "server.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[NAME] = module
    spec.loader.exec_module(module)
    return module
