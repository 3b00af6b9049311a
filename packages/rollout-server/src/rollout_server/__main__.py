"""``python -m rollout_server``: the ``rollout-server`` command."""

from __future__ import annotations

import sys

from .cli._cli import main

if __name__ == "__main__":
    sys.exit(main())
