"""The example grader: reward 1.0 when the agent's final answer equals the label, else 0.0.

The final answer is the last number in the last assistant message that has text. Numbers
compare numerically (``"42"``, ``"42.0"`` and ``"The answer is 42."`` all match the label
``42``, within a relative tolerance of 1e-9); a non-numeric label is compared as text,
ignoring case and surrounding whitespace and punctuation.
"""

from __future__ import annotations

import fractions
import math
import re
from typing import Any, Final

from rollout_server import Grader, GraderContext

__all__ = ["AnswerGrader", "final_answer_text", "parse_number"]

_NUMBER: Final = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
REL_TOLERANCE: Final = 1e-9


def parse_number(text: str) -> fractions.Fraction | None:
    """The last number written in ``text`` (thousands separators allowed), or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return fractions.Fraction(found[-1].replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def final_answer_text(messages: list[dict[str, Any]]) -> str | None:
    """The text of the last assistant message that has text, or None."""
    for message in reversed(messages):
        if message.get("role") != "assistant":
            continue
        content = message.get("content")
        if isinstance(content, list):
            content = " ".join(
                str(part.get("text", "")) for part in content if isinstance(part, dict)
            )
        if isinstance(content, str) and content.strip():
            return content
    return None


def _matches(answer: str, label: str) -> bool:
    expected = parse_number(label)
    if expected is not None and re.fullmatch(r"\s*" + _NUMBER.pattern + r"\s*", label):
        got = parse_number(answer)
        if got is None:
            return False
        return math.isclose(float(got), float(expected), rel_tol=REL_TOLERANCE, abs_tol=1e-12)
    strip = " \t\n.!?\"'"
    return answer.strip(strip).casefold().endswith(label.strip(strip).casefold())


class AnswerGrader(Grader):
    """Reward 1.0 for a final answer equal to the label, 0.0 otherwise (see the module)."""

    async def grade(self, ctx: GraderContext) -> None:
        """Compare the sample's final answer with ``ctx.label`` and set the reward.

        Raises:
            ValueError: When the request has no label (this grader needs one).
        """
        if ctx.label is None:
            raise ValueError("AnswerGrader needs a label: give every dataset row a 'label'")
        sample = ctx.sample
        answer = final_answer_text(sample.messages) if sample is not None else None
        ctx.set_reward(1.0 if answer is not None and _matches(answer, ctx.label) else 0.0)
