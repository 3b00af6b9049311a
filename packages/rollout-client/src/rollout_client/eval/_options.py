"""The options of one evaluation run (:class:`EvalOptions`) and their defaults."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Final

from rollout_types import check_seconds

from ._errors import EvalInputError

__all__ = [
    "DEFAULT_ITEM_DEADLINE_SEC",
    "DEFAULT_MAX_CONSECUTIVE_INFRA_FAILURES",
    "DEFAULT_OUTPUT_DIR",
    "ITEM_DEADLINE_SLACK_SEC",
    "EvalOptions",
]

DEFAULT_OUTPUT_DIR: Final = Path(".rollout-eval")
"""Where runs go without ``--output``."""

DEFAULT_MAX_CONSECUTIVE_INFRA_FAILURES: Final = 5
"""Infrastructure failures in a row that stop a run early (0 disables the stop)."""

DEFAULT_ITEM_DEADLINE_SEC: Final = 3600.0
"""Bound on one rollout when the agent and grader timeouts are not both given."""

ITEM_DEADLINE_SLACK_SEC: Final = 60.0
"""Added to ``agent + grader`` timeouts to bound one rollout from admission to result."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EvalOptions:
    """Everything one evaluation run needs.

    Attributes:
        dataset: The JSONL or CSV dataset.
        server_url: Base URL of the rollout server.
        extra_server_urls: Base URLs of further rollout servers; with any, rollouts are
            spread over all of them by :class:`~rollout_client.RolloutClientPool`
            (default none).
        chat_url: OpenAI-compatible base URL of the model (sent as ``chat_completions_url``).
        server_api_key: Bearer key of the rollout server, or None.
        llm_api_key: Key of the chat endpoint (sent as ``llm_api_key``), or None.
        concurrency: Most rollouts in flight; None: the server's reported capacity.
        n: Repetitions of each row (default 1).
        rows: ``--rows`` selection (``"3,7,10-20"``, 0-based), or None for every row.
        agent_timeout_sec: Per-rollout workflow budget sent to the server, or None.
        grader_timeout_sec: Per-rollout grader budget sent to the server, or None.
        output: Directory holding the runs (default ``.rollout-eval``).
        name: Run name (default: the dataset file's stem).
        mode: ``auto`` (resume when the run exists, else start), ``resume`` (the run must
            exist) or ``fresh`` (archive an existing run and start over).
        pass_threshold: Reward at or above which a success passes (default 1.0).
        max_consecutive_infra_failures: Infrastructure failures in a row that stop the
            run (default 5; 0 never stops).
        item_deadline_sec: Bound on one rollout from admission to result; default
            ``agent + grader + 60`` s when both timeouts are given, else 3600 s.
        admission_timeout_sec: Bound on one admission including 429 retries; default
            ``item_deadline_sec * concurrency`` (a full queue ahead of it).
        progress: ``auto``, ``bar``, ``plain`` or ``off``.
        progress_interval_sec: Seconds between plain progress lines (default 10.0).
    """

    dataset: Path
    server_url: str
    chat_url: str
    extra_server_urls: tuple[str, ...] = ()
    server_api_key: str | None = dataclasses.field(default=None, repr=False)
    llm_api_key: str | None = dataclasses.field(default=None, repr=False)
    concurrency: int | None = None
    n: int = 1
    rows: str | None = None
    agent_timeout_sec: float | None = None
    grader_timeout_sec: float | None = None
    output: Path = DEFAULT_OUTPUT_DIR
    name: str | None = None
    mode: str = "auto"
    pass_threshold: float = 1.0
    max_consecutive_infra_failures: int = DEFAULT_MAX_CONSECUTIVE_INFRA_FAILURES
    item_deadline_sec: float | None = None
    admission_timeout_sec: float | None = None
    progress: str = "auto"
    progress_interval_sec: float = 10.0

    def validate(self) -> None:
        """Check every option; raise :class:`EvalInputError` naming the bad one."""
        if self.mode not in ("auto", "resume", "fresh"):
            raise EvalInputError(f"mode must be 'auto', 'resume' or 'fresh', not {self.mode!r}")
        if self.concurrency is not None and self.concurrency < 1:
            raise EvalInputError(f"--concurrency must be at least 1, got {self.concurrency}")
        if self.n < 1:
            raise EvalInputError(f"--n must be at least 1, got {self.n}")
        if self.max_consecutive_infra_failures < 0:
            raise EvalInputError(
                "--max-consecutive-infra-failures must be 0 (never stop) or more, got "
                f"{self.max_consecutive_infra_failures}"
            )
        for flag, value in (
            ("--agent-timeout-sec", self.agent_timeout_sec),
            ("--grader-timeout-sec", self.grader_timeout_sec),
            ("--item-deadline-sec", self.item_deadline_sec),
            ("--admission-timeout-sec", self.admission_timeout_sec),
        ):
            if value is not None:
                check_seconds(flag, value, error=EvalInputError)
        if not math.isfinite(self.pass_threshold):
            raise EvalInputError(f"--pass-threshold must be finite, got {self.pass_threshold}")
        for flag, url in (
            *(("--server", server) for server in self.server_urls),
            ("--chat-url", self.chat_url),
        ):
            if not url.startswith(("http://", "https://")):
                raise EvalInputError(f"{flag} must be an http:// or https:// URL, got {url!r}")
        stripped = [url.rstrip("/") for url in self.server_urls]
        if len(set(stripped)) != len(stripped):
            raise EvalInputError(f"--server lists a URL twice: {list(self.server_urls)}")
        if self.name is not None and (
            not self.name.strip() or "/" in self.name or self.name in (".", "..")
        ):
            raise EvalInputError(
                f"--name must be a plain directory name (no '/'), got {self.name!r}"
            )

    @property
    def server_urls(self) -> tuple[str, ...]:
        """Every rollout server (``server_url``, then ``extra_server_urls``)."""
        return (self.server_url, *self.extra_server_urls)

    @property
    def run_name(self) -> str:
        """The run's name (``name``, else the dataset's file stem)."""
        return self.name or self.dataset.stem or "run"

    def deadline_sec(self) -> float:
        """The bound on one rollout (see :attr:`item_deadline_sec`)."""
        if self.item_deadline_sec is not None:
            return self.item_deadline_sec
        if self.agent_timeout_sec is not None and self.grader_timeout_sec is not None:
            return self.agent_timeout_sec + self.grader_timeout_sec + ITEM_DEADLINE_SLACK_SEC
        return DEFAULT_ITEM_DEADLINE_SEC
