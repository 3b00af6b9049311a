"""Order statistics for latencies and repetitions."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = ["percentile", "summarize"]


def percentile(values: Sequence[float], fraction: float) -> float:
    """The ``fraction`` quantile of ``values`` by linear interpolation between ranks.

    Args:
        values: At least one finite number, in any order.
        fraction: Between 0 and 1 (0.5 is the median, 0.99 the p99).

    Returns:
        The interpolated quantile.

    Raises:
        ValueError: When ``values`` is empty or ``fraction`` is outside [0, 1].
    """
    if not values:
        raise ValueError("percentile() of no values")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be within [0, 1]; got {fraction!r}")
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(values: Sequence[float]) -> dict[str, float | int]:
    """Median, minimum and maximum of the repetitions of one metric.

    Returns:
        ``{"median", "min", "max", "n"}``.

    Raises:
        ValueError: When ``values`` is empty.
    """
    if not values:
        raise ValueError("summarize() of no values")
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }
