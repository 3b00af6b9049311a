"""``python -m benchmarks.profiles FILE``: where a py-spy profile of a server spent its samples.

Reads collapsed stacks (``py-spy record --format raw``, as ``python -m benchmarks
--py-spy PATH`` writes them) and prints the functions with the largest inclusive and
self shares of all samples.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Final

__all__ = ["main", "shares"]

_FRAME: Final = re.compile(r"(?P<function>.*) \((?P<file>.*?)(?::\d+)?\)$")
_PREFIXES: Final = (
    re.compile(r".*/site-packages/"),
    re.compile(r".*/src/"),
    re.compile(r".*/lib/python3\.\d+/"),
)


def _frame_name(frame: str) -> str:
    match = _FRAME.match(frame)
    if match is None:
        return frame
    file = match["file"]
    for prefix in _PREFIXES:
        file = prefix.sub("", file)
    return f"{match['function']} ({file})"


def shares(
    lines: Iterable[str],
) -> tuple[int, collections.Counter[str], collections.Counter[str]]:
    """Total samples and, per function, its inclusive and self sample counts.

    Args:
        lines: Collapsed stacks: ``frame;frame;...;leaf COUNT`` per line.

    Returns:
        ``(total, inclusive, self)``.
    """
    total = 0
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    for line in lines:
        stack, _, count_text = line.strip().rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_frame_name(frame) for frame in stack.split(";")]
        total += count
        for frame in set(frames):
            inclusive[frame] += count
        own[frames[-1]] += count
    return total, inclusive, own


def main(argv: Sequence[str] | None = None) -> int:
    """Print the top functions of one profile; 1 when it holds no samples."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    with open(args.profile, encoding="utf-8") as stacks:
        total, inclusive, own = shares(stacks)
    if not total:
        sys.stdout.write(f"{args.profile}: no samples\n")
        return 1
    out = [f"{args.profile}: {total} samples", "inclusive:"]
    out += [f"{100 * n / total:6.1f}%  {name}" for name, n in inclusive.most_common(args.top)]
    out.append("self:")
    out += [f"{100 * n / total:6.1f}%  {name}" for name, n in own.most_common(args.top)]
    sys.stdout.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
