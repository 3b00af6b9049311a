"""What a user writes to score a rollout: a :class:`Grader` and its config."""

from __future__ import annotations

import abc
import math
import numbers
from pathlib import Path
from typing import Any

import attrs

from ._backend import Sample
from ._config import BaseConfig
from ._lazydir import LazyDirectory, directory_repr, resolve_directory

__all__ = ["Grader", "GraderConfig", "GraderContext"]


@attrs.frozen(kw_only=True, init=False)
class GraderConfig(BaseConfig):
    """Configuration of a grader: ``name``, ``description``, ``concurrency``, ``extra``.

    ``concurrency`` is accepted for symmetry and ignored (grading uses the workflow's
    slot). The same instance is handed to every grading run (it is not copied).
    """


@attrs.define(kw_only=True, eq=False)
class GraderContext:
    """What one grading run receives.

    Attributes:
        rollout_id: The admitted id.
        label: The request's ``label`` (typically the expected answer), or None.
        sample: The workflow's sample, the same object the rollout reports: the grader
            changes it in place (through :meth:`set_reward`). None when the workflow
            produced none.
        metadata: The request's ``metadata``, or None.
        artifacts_dir: The rollout's artifacts directory (created on first read, as for
            the workflow), or None.
        project_path: Always None for LocalBackend (osmosis-ai compatibility).
    """

    rollout_id: str
    label: str | None = None
    sample: Sample | None = None
    metadata: dict[str, Any] | None = None
    _artifacts_dir: Path | LazyDirectory | None = attrs.field(
        default=None, alias="artifacts_dir", repr=directory_repr
    )
    project_path: str | None = None

    @property
    def artifacts_dir(self) -> Path | None:
        """The rollout's artifacts directory, created on first read; None when it cannot
        be created (a WARNING says why)."""
        return resolve_directory(self._artifacts_dir)

    def set_reward(self, reward: float) -> None:
        """Set the sample's reward.

        Raises:
            ValueError: When there is no sample (``GraderContext has no sample to
                reward``) or ``reward`` is not a finite number.
        """
        if self.sample is None:
            raise ValueError("GraderContext has no sample to reward")
        given: object = reward
        if isinstance(given, bool) or not isinstance(given, numbers.Real):
            raise ValueError(f"reward must be a finite number; got {reward!r}")
        value = float(given)
        if not math.isfinite(value):
            raise ValueError(f"reward must be a finite number; got {reward!r}")
        self.sample.reward = value

    def set_remove_sample(self, remove: bool = True) -> None:
        """Ask for the sample to be left out of training and scoring.

        A removed sample needs no reward, and its reward is null on the wire.

        Raises:
            ValueError: When there is no sample.
        """
        if self.sample is None:
            raise ValueError("GraderContext has no sample to remove")
        self.sample.remove_sample = bool(remove)


class Grader(abc.ABC):
    """Base class of graders: implement :meth:`grade`.

    Args:
        config: The backend's grader config (None when it has none); kept as
            ``self.config``.
    """

    def __init__(self, config: GraderConfig | None = None) -> None:
        self.config = config

    @abc.abstractmethod
    async def grade(self, ctx: GraderContext) -> None:
        """Score ``ctx.sample``: call ``ctx.set_reward(x)`` (or ``ctx.set_remove_sample()``).

        After it returns, a sample that is kept must carry a reward; otherwise grading fails
        as ``validation_error`` (``Sample has no reward after grading``).
        """
