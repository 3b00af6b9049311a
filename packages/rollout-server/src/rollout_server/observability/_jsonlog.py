"""JSON log lines for log shippers (``rollout-server serve --log-format json``).

:class:`JsonFormatter` turns each log record into one JSON object on one line::

    {"timestamp": "2026-12-03T08:20:25.123Z", "level": "INFO",
     "logger": "rollout_server.registry", "message": "Rollout r1 finished: status=failure
     err_category=timeout duration=30.012s reward=None err_message=...",
     "rollout_id": "r1", "status": "failure", "category": "timeout"}

The per-rollout lines of the server and of LocalBackend pass ``rollout_id``, ``status``
and ``category`` (the error category) through ``extra=`` (:func:`log_fields`); the
formatter adds those it finds, the exception's traceback as ``exception``, and the
OpenTelemetry ``trace_id``/``span_id`` of the span current where the line was logged,
when tracing is on. Every line is ASCII (``json.dumps`` escapes the rest), so no id or
message can make a line undecodable.
"""

from __future__ import annotations

import datetime
import json
import logging
from typing import Any, Final

from . import _tracing

__all__ = ["LOG_FIELDS", "JsonFormatter", "log_fields"]

LOG_FIELDS: Final = ("rollout_id", "status", "category")
"""The ``extra=`` keys :class:`JsonFormatter` copies into a line when a record has them."""


def log_fields(rollout_id: str, status: object = None, category: object = None) -> dict[str, Any]:
    """The ``extra=`` of a log line about one rollout (status and category when known).

    Args:
        rollout_id: The rollout's id.
        status: Its status (a ``RolloutStatus`` or a string), or None.
        category: Its error category (a ``RolloutErrorCategory`` or a string), or None.
    """
    fields: dict[str, Any] = {"rollout_id": rollout_id}
    if status is not None:
        fields["status"] = str(status)
    if category is not None:
        fields["category"] = str(category)
    return fields


class JsonFormatter(logging.Formatter):
    """Format each record as one line of JSON (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as a JSON object: ``timestamp`` (UTC, ISO 8601, milliseconds),
        ``level``, ``logger``, ``message``, then the optional fields."""
        stamp = datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC)
        document: dict[str, Any] = {
            "timestamp": stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        attributes = record.__dict__
        for key in LOG_FIELDS:
            value = attributes.get(key)
            if value is not None:
                document[key] = str(value)
        ids = _tracing.current_trace_ids()
        if ids is not None:
            document["trace_id"], document["span_id"] = ids
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            document["exception"] = record.exc_text
        if record.stack_info:
            document["stack"] = self.formatStack(record.stack_info)
        return json.dumps(document, default=str)
