"""Make what user code reports safe for strict JSON, so telemetry never costs a reward.

This is the server's wire-sample pipeline (spec section 4.7): ``metrics`` and
``extra_fields`` are fitted to JSON value by value, and a sample whose ``messages`` still
cannot be encoded is replaced by a minimal one that keeps label, reward and flag. The
backend's ``/health`` fields and ``trajectory.json`` are fitted the same way. Only the server
needs this (a client receives JSON that is strict already), so it lives here rather than in
``rollout_types``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from decimal import Decimal
from typing import Any, Final

import attrs

from rollout_types import RolloutSample, converter, dumps

from ._logtext import get_logger, log_text

__all__ = ["fit_json", "json_safe_sample", "scrub_text"]

logger: Final = get_logger("rollout_server.sanitize")

_DROP: Final = object()


def scrub_text(value: str) -> str:
    """Replace lone surrogates (and other unencodable code points) so ``value`` is UTF-8."""
    return value.encode("utf-8", "replace").decode("utf-8")


def _fit(value: Any, path: str, dropped: list[str], depth: int) -> Any:
    if depth > 200:
        dropped.append(path)
        return _DROP
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return scrub_text(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real | Decimal):
        number = float(value)
        if math.isfinite(number):
            return number
        dropped.append(path)
        return _DROP
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            name = _fit_key(key)
            if name is None:
                dropped.append(f"{path}.{key!r}")
                continue
            fitted = _fit(item, f"{path}.{name}", dropped, depth + 1)
            if fitted is not _DROP:
                out[name] = fitted
        return out
    if isinstance(value, list | tuple):
        items = [_fit(item, f"{path}[{i}]", dropped, depth + 1) for i, item in enumerate(value)]
        return [item for item in items if item is not _DROP]
    dropped.append(path)
    return _DROP


def _fit_key(key: Any) -> str | None:
    """A mapping key as a JSON object key: strings stay, numbers become strings."""
    if isinstance(key, str):
        return scrub_text(key)
    if isinstance(key, bool) or not isinstance(key, numbers.Real | Decimal):
        return None
    return str(int(key) if isinstance(key, numbers.Integral) else float(key))


def fit_json(value: Any, path: str = "$") -> tuple[Any, list[str]]:
    """Fit ``value`` to strict JSON.

    Numeric scalars of other libraries (NumPy and the like) become ``int``/``float``;
    non-finite numbers, booleans and other non-numeric keys, and values JSON cannot encode
    are dropped; tuples become lists; numeric keys become strings.

    Args:
        value: Any Python value.
        path: The name of ``value`` in the returned paths; default ``"$"``.

    Returns:
        The fitted value (``None`` if ``value`` itself had to be dropped) and the paths of
        everything dropped.
    """
    dropped: list[str] = []
    fitted = _fit(value, path, dropped, 0)
    return (None if fitted is _DROP else fitted), dropped


def json_safe_sample(sample: RolloutSample, *, context: str = "") -> RolloutSample:
    """Return ``sample`` in a form that encodes as strict JSON, keeping its reward.

    ``metrics`` and ``extra_fields`` are fitted with :func:`fit_json` (one warning lists
    what was dropped). If the sample still does not encode (typically non-JSON values in
    ``messages``), a minimal sample ``{messages: [], metrics: {}, extra_fields: {}}`` with
    the same label, reward and ``remove_sample`` is returned and a warning logged.

    Args:
        sample: The sample as user code produced it.
        context: Text for the log lines, such as the rollout id; default empty.
    """
    metrics, dropped_metrics = fit_json(sample.metrics, "metrics")
    extra, dropped_extra = fit_json(sample.extra_fields, "extra_fields")
    dropped = dropped_metrics + dropped_extra
    if dropped:
        logger.warning("Dropped non-JSON sample values%s: %s", _for(context), ", ".join(dropped))
    reward = sample.reward
    if reward is not None:
        fitted_reward, _ = fit_json(reward)
        reward = fitted_reward if isinstance(fitted_reward, int | float) else None
    label = scrub_text(sample.label) if isinstance(sample.label, str) else None
    fitted = attrs.evolve(
        sample,
        metrics=metrics if isinstance(metrics, dict) else {},
        extra_fields=extra if isinstance(extra, dict) else {},
        label=label,
        reward=reward,
        remove_sample=bool(sample.remove_sample),
    )
    try:
        dumps(converter.unstructure(fitted))
    except (TypeError, ValueError, RecursionError) as exc:
        logger.warning(
            "Sample%s does not encode as JSON (%s); sending a minimal sample", _for(context), exc
        )
        return RolloutSample(
            messages=[], label=label, reward=reward, remove_sample=fitted.remove_sample
        )
    return fitted


def _for(context: str) -> str:
    return f" of rollout {log_text(context)}" if context else ""
