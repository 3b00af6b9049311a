"""What the chat stand-in answers (see ``server.py``): the rules that turn a question
into an arithmetic expression (:func:`question_to_expression`), evaluated with the example
agent's own calculator, and the assistant message a chat request gets (:func:`decide`):
a tool call while no tool result has come back, then the answer, wrong with the
configured probability.
"""

from __future__ import annotations

import fractions
import hashlib
import importlib.util
import json
import math
import re
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any, Final

from standin_tokens import render_prompt, text_of, unit

__all__ = ["ExpressionError", "decide", "question_to_expression"]

_NUMBER = r"(-?\d+(?:\.\d+)?)"
_RULES: Final[tuple[tuple[re.Pattern[str], str], ...]] = tuple(
    (re.compile(pattern), replacement)
    for pattern, replacement in (
        (rf"{_NUMBER}\s*(?:percent|%)\s+of\s+{_NUMBER}", r"(\1 * \2 / 100)"),
        (rf"the\s+sum\s+of\s+{_NUMBER}\s+and\s+{_NUMBER}", r"(\1 + \2)"),
        (rf"the\s+product\s+of\s+{_NUMBER}\s+and\s+{_NUMBER}", r"(\1 * \2)"),
        (rf"the\s+difference\s+between\s+{_NUMBER}\s+and\s+{_NUMBER}", r"(\1 - \2)"),
        (rf"the\s+quotient\s+of\s+{_NUMBER}\s+and\s+{_NUMBER}", r"(\1 / \2)"),
        (rf"the\s+remainder\s+when\s+{_NUMBER}\s+is\s+divided\s+by\s+{_NUMBER}", r"(\1 % \2)"),
        (rf"the\s+square\s+of\s+{_NUMBER}", r"(\1 * \1)"),
        (rf"the\s+cube\s+of\s+{_NUMBER}", r"(\1 * \1 * \1)"),
        (rf"{_NUMBER}\s+squared", r"(\1 * \1)"),
        (rf"{_NUMBER}\s+cubed", r"(\1 * \1 * \1)"),
        # Word-problem templates of the demo dataset.
        (rf"costs?\s+{_NUMBER}\s+dollars?\b.*?\b{_NUMBER}\s+\w+\s+cost", r"(\1 * \2)"),
        (rf"{_NUMBER}\s+\w+\s+with\s+{_NUMBER}\s+\w+\s+in\s+each", r"(\1 * \2)"),
        (rf"had\s+{_NUMBER}\b.*?\bgave\s+away\s+{_NUMBER}", r"(\1 - \2)"),
        (
            rf"travels?\s+{_NUMBER}\s+\w+\s+(?:an|per)\s+hour\s+for\s+{_NUMBER}\s+hours?",
            r"(\1 * \2)",
        ),
        (
            rf"{_NUMBER}\s+\w+\s+(?:are\s+)?shared\s+equally\s+(?:among|between)\s+{_NUMBER}",
            r"(\1 / \2)",
        ),
        (rf"{_NUMBER}\s+divided\s+by\s+{_NUMBER}", r"(\1 / \2)"),
        (rf"{_NUMBER}\s+(?:times|multiplied\s+by)\s+{_NUMBER}", r"(\1 * \2)"),
        (rf"{_NUMBER}\s+plus\s+{_NUMBER}", r"(\1 + \2)"),
        (rf"{_NUMBER}\s+minus\s+{_NUMBER}", r"(\1 - \2)"),
    )
)
_EXPRESSION = re.compile(r"[-+*/%().\d\s]+")


class ExpressionError(ValueError):
    """The text holds no arithmetic expression the stand-in can evaluate."""


def _load_calculator() -> ModuleType:
    """The example agent's calculator module, loaded from its file.

    The stand-in evaluates with the very calculator the example agent offers as its tool
    (``examples/calculator_agent/calculator.py``, standard library only). It is loaded by
    path, not as ``calculator_agent.calculator``, so that the stand-in needs neither
    ``examples/`` on ``sys.path`` nor the agent's own imports (rollout-server).
    """
    path = Path(__file__).resolve().parents[2] / "examples" / "calculator_agent" / "calculator.py"
    spec = importlib.util.spec_from_file_location("chat_standin_calculator", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the example calculator from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_CALCULATOR: Final = _load_calculator()


def question_to_expression(question: str) -> str:
    """Turn a question into an arithmetic expression (``+ - * / %``, parentheses).

    Raises:
        ExpressionError: If no expression can be found.
    """
    text = question.lower().replace("\u00d7", "*").replace("\u00f7", "/").replace(",", "")
    for pattern, replacement in _RULES:
        text = pattern.sub(replacement, text)
    candidates = []
    for match in _EXPRESSION.finditer(text):
        chunk = match.group().strip().rstrip(".").strip()
        if re.search(r"\d", chunk):
            candidates.append(chunk)
    for chunk in sorted(candidates, key=len, reverse=True):
        try:
            _CALCULATOR.calculate(chunk)
        except _CALCULATOR.CalculatorError:
            continue
        return " ".join(chunk.split())
    raise ExpressionError(f"no arithmetic expression in {question!r}")


_TOOL_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def _number_in_tool_result(content: Any) -> fractions.Fraction | None:
    text = text_of(content)
    try:
        data = json.loads(text)
    except (ValueError, TypeError):
        data = None
    if isinstance(data, int | float) and not isinstance(data, bool) and math.isfinite(data):
        return fractions.Fraction(str(data))
    if isinstance(data, dict):
        if data.get("error"):
            return None
        for key in ("result", "value", "answer"):
            value = data.get(key)
            if (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and math.isfinite(value)
            ):
                return fractions.Fraction(str(value))
            if isinstance(value, str):
                text = value
                break
    if "error" in text.lower():
        return None
    numbers = _TOOL_NUMBER.findall(text)
    if not numbers:
        return None
    try:
        return fractions.Fraction(numbers[-1])
    except ValueError:
        return None


def _pick_tool(body: dict[str, Any]) -> tuple[str, str] | None:
    """The (name, argument name) of the tool to call, or None when no function tool is offered."""
    if body.get("tool_choice") == "none":
        return None
    tools = [
        t
        for t in body.get("tools") or ()
        if isinstance(t, dict) and t.get("type", "function") == "function"
    ]
    functions: list[dict[str, Any]] = [
        t["function"] for t in tools if isinstance(t.get("function"), dict)
    ]
    if not functions:
        return None
    chosen = next((f for f in functions if f.get("name") == "calculator"), functions[0])
    properties = (chosen.get("parameters") or {}).get("properties") or {}
    argument = (
        "expression" if "expression" in properties or not properties else next(iter(properties))
    )
    return str(chosen.get("name", "calculator")), argument


def decide(
    body: dict[str, Any], *, seed: int, error_rate: float, answered: Counter[str]
) -> dict[str, Any]:
    """The assistant message (content or tool_calls) for a chat request.

    Args:
        body: The request's document.
        seed: The seed of the wrong-answer draw.
        error_rate: Probability of a wrong final answer, in [0, 1].
        answered: How many times each question was answered so far (updated).
    """
    messages = [m for m in body["messages"] if isinstance(m, dict)]
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last_user is None:
        return {"role": "assistant", "content": "Please ask me an arithmetic question."}
    question = text_of(messages[last_user].get("content"))
    after = messages[last_user + 1 :]
    tool_results = [m for m in after if m.get("role") == "tool"]
    tool = _pick_tool(body)
    if tool_results:
        value = _number_in_tool_result(tool_results[-1].get("content"))
        if value is None:
            return {
                "role": "assistant",
                "content": "The calculator reported an error, so I cannot answer.",
            }
        return {
            "role": "assistant",
            "content": _final_answer(
                question, value, seed=seed, error_rate=error_rate, answered=answered
            ),
        }
    try:
        expression = question_to_expression(question)
    except ExpressionError:
        return {
            "role": "assistant",
            "content": "I cannot find an arithmetic question in that message.",
        }
    if tool is not None:
        name, argument = tool
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    # Deterministic (a digest of the prompt), so a rerun's prompts repeat.
                    "id": f"call_{hashlib.sha256(render_prompt(body).encode()).hexdigest()[:24]}",
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps({argument: expression})},
                }
            ],
        }
    try:
        value = _CALCULATOR.calculate(expression)
    except _CALCULATOR.CalculatorError:
        return {"role": "assistant", "content": "That expression cannot be evaluated."}
    return {
        "role": "assistant",
        "content": _final_answer(
            question, value, seed=seed, error_rate=error_rate, answered=answered
        ),
    }


def _final_answer(
    question: str,
    value: fractions.Fraction,
    *,
    seed: int,
    error_rate: float,
    answered: Counter[str],
) -> str:
    occurrence = answered[question]
    answered[question] += 1
    if unit(seed, "wrong", question, occurrence) < error_rate:
        value += 1 + int(unit(seed, "delta", question, occurrence) * 9)
    return f"The answer is {_CALCULATOR.format_number(value)}."
