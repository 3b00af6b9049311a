"""The agent's one tool: a calculator that evaluates plain arithmetic exactly.

Only numbers, ``+ - * / // % **`` (small integer exponents) and parentheses are allowed:
the expression is parsed with :mod:`ast` and walked, never passed to ``eval``.
"""

from __future__ import annotations

import ast
import fractions
from typing import Any, Final

__all__ = ["TOOL_SPEC", "CalculatorError", "calculate", "format_number"]

MAX_EXPONENT: Final = 64
"""Largest absolute integer exponent ``**`` accepts."""

MAX_EXPRESSION_CHARS: Final = 500
"""Longer expressions are refused."""

TOOL_SPEC: Final[dict[str, Any]] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": (
            "Evaluate an arithmetic expression exactly. Supports numbers, + - * / // % ** and "
            "parentheses, e.g. '(17 + 4) * 3'."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "The expression to evaluate."}
            },
            "required": ["expression"],
        },
    },
}
"""The OpenAI ``tools`` entry that offers the calculator."""


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, is too long, or divides by zero."""


def _binary(op: ast.operator, left: fractions.Fraction, right: fractions.Fraction) -> Any:
    if isinstance(op, ast.Add):
        return left + right
    if isinstance(op, ast.Sub):
        return left - right
    if isinstance(op, ast.Mult):
        return left * right
    if isinstance(op, ast.Div):
        return left / right
    if isinstance(op, ast.FloorDiv):
        return fractions.Fraction(left // right)
    if isinstance(op, ast.Mod):
        return left % right
    if isinstance(op, ast.Pow):
        if right.denominator != 1 or abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponents must be integers within +-{MAX_EXPONENT}")
        return left ** int(right)
    raise CalculatorError(f"unsupported operator {type(op).__name__}")


def _walk(node: ast.AST) -> fractions.Fraction:
    if isinstance(node, ast.Expression):
        return _walk(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return fractions.Fraction(str(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _walk(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _walk(node.left), _walk(node.right)
        try:
            return fractions.Fraction(_binary(node.op, left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
    raise CalculatorError(
        f"only numbers, + - * / // % ** and parentheses are allowed, not {type(node).__name__}"
    )


def calculate(expression: str) -> fractions.Fraction:
    """Evaluate ``expression`` exactly.

    Raises:
        CalculatorError: If it is not plain arithmetic, too long, or divides by zero.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from None
    return _walk(tree)


def format_number(value: fractions.Fraction) -> str:
    """``391`` for integers, otherwise up to six decimals without trailing zeros."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")
