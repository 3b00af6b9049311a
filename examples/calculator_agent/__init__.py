"""Example rollout project: a calculator-using chat agent, its grader and a backend factory."""

from __future__ import annotations

from .agent import CalculatorAgent, ChatEndpointError
from .backend import create_backend
from .grader import AnswerGrader

__all__ = ["AnswerGrader", "CalculatorAgent", "ChatEndpointError", "create_backend"]
