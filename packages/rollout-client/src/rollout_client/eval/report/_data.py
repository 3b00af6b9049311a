"""What the HTML report shows, read from a run directory.

The report is a function of the run directory alone: the items come from
``manifest.json`` (rows and ``n``), each item's state from its last record in
``events.jsonl``, and the summary is computed again from those (so a run killed before it
wrote ``summary.json`` still gets a correct report); ``summary.json`` only contributes the
pass threshold and the run's context (concurrency, why it stopped). Conversations come
from ``samples.jsonl``, matched to each item's final rollout id.

The report's size is bounded whatever the run's size:

* at most :data:`MAX_LISTED_ITEMS` items are listed, in row order; when a run has more,
  the failures are listed first, then the other items that did not pass, then passes;
* each conversation is cut to :data:`CONVERSATION_BUDGET_CHARS` divided by the number of
  listed items that have a journal record, at most :data:`MAX_CONVERSATION_CHARS` (so
  all of them together hold at most the budget; 2,000 characters each when the most
  items are listed): the first message and as many of the last
  ones as fit are kept, the middle ones are counted, and a message longer than a quarter
  of the conversation's budget is cut with a note. ``samples.jsonl`` keeps them whole.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final

from .._dataset import parse_row_selection
from .._errors import EvalInputError
from .._failures import FAILED_OUTCOMES
from .._journal import JournalRecord, latest_by_item, read_journal
from .._manifest import Manifest, read_manifest
from .._summary import summarize

__all__ = [
    "CONVERSATION_BUDGET_CHARS",
    "MAX_CONVERSATION_CHARS",
    "MAX_LISTED_ITEMS",
    "Conversation",
    "Item",
    "Message",
    "RunData",
    "clip_conversation",
    "load_run",
]

MAX_LISTED_ITEMS: Final = 2000
"""Items listed in the report's table (with their conversations); the rest are counted."""

CONVERSATION_BUDGET_CHARS: Final = 4_000_000
"""Characters of conversation text shared by all listed items."""

MAX_CONVERSATION_CHARS: Final = 64_000
"""Most characters of one conversation the report shows."""

Key = tuple[int, int]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Message:
    """One chat message as the report shows it.

    ``role`` is the message's role (``"?"`` when it has none), ``label`` what else names
    it (a tool's name or call id), ``text`` its content, ``calls`` its tool calls, one per
    line as ``name(arguments)``; ``cut`` counts characters left out of ``text``.
    """

    role: str
    label: str
    text: str
    calls: str
    cut: int = 0

    @property
    def size(self) -> int:
        """Characters the message shows."""
        return len(self.text) + len(self.calls) + len(self.label)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Conversation:
    """The final conversation of one rollout, cut to the report's budget.

    ``head`` and ``tail`` are the messages shown; ``omitted`` messages between them are
    not. ``line`` is the conversation's line in ``samples.jsonl``.
    """

    head: tuple[Message, ...]
    tail: tuple[Message, ...]
    omitted: int
    metrics: Mapping[str, Any]
    line: int

    @property
    def length(self) -> int:
        """Messages of the whole conversation, shown or not."""
        return len(self.head) + self.omitted + len(self.tail)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Item:
    """One work item: its key ``(row, run)``, final record (None: not started) and conversation."""

    key: Key
    record: JournalRecord | None
    conversation: Conversation | None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RunData:
    """Everything the report shows.

    Attributes:
        run_dir: The run directory.
        manifest: Its manifest.
        summary: The summary, computed again from the journal.
        items: The listed items, in row order (at most :data:`MAX_LISTED_ITEMS`).
        final_records: Each item's final record, in item order (all items, not only the
            listed ones).
        notes: Problems met while reading the files, for the reader of the report.
    """

    run_dir: Path
    manifest: Manifest
    summary: dict[str, Any]
    items: tuple[Item, ...]
    final_records: tuple[JournalRecord, ...]
    notes: tuple[str, ...]


def _selected_items(manifest: Manifest, path: Path) -> list[Key]:
    rows_spec = manifest.inputs.rows
    try:
        rows = parse_row_selection(rows_spec, sys.maxsize) if rows_spec.strip() else ()
    except EvalInputError:
        raise EvalInputError(
            f"{path}: the row selection {rows_spec!r} is not valid; the manifest was changed by "
            "something other than rollout-eval"
        ) from None
    return [(row, run) for row in rows for run in range(manifest.inputs.n)]


def _previous_summary(path: Path, notes: list[str]) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        notes.append("summary.json is missing (the run did not finish writing it)")
        return {}
    except (OSError, ValueError) as exc:
        notes.append(f"summary.json cannot be read ({exc})")
        return {}
    return data if isinstance(data, dict) else {}


def _text(value: Any) -> str:
    """Message content as text: strings as is, text parts joined, anything else as JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(
            part["text"]
            if isinstance(part, dict) and isinstance(part.get("text"), str)
            else _json(part)
            for part in value
        )
    return _json(value)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


def _calls(value: Any) -> str:
    if not value:
        return ""
    if not isinstance(value, list):
        return _json(value)
    lines = []
    for call in value:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            arguments = function.get("arguments")
            lines.append(
                f"→ {function.get('name', '?')}"
                f"({arguments if isinstance(arguments, str) else _json(arguments)})"
            )
        else:
            lines.append(_json(call))
    return "\n".join(lines)


_SHOWN_KEYS: Final = frozenset({"role", "content", "tool_calls", "name", "tool_call_id"})


def _message(raw: Any, limit: int) -> Message:
    if not isinstance(raw, dict):
        return _cut(Message(role="?", label="", text=_json(raw), calls=""), limit)
    label = " ".join(
        str(raw[key]) for key in ("name", "tool_call_id") if isinstance(raw.get(key), str | int)
    )
    text = _text(raw.get("content"))
    extra = {
        key: value
        for key, value in raw.items()
        if key not in _SHOWN_KEYS and value not in (None, "", [], {})
    }
    if extra:
        text += "".join(f"\n[{key}] {_text(value)}" for key, value in extra.items())
    role = raw.get("role")
    message = Message(
        role=role if isinstance(role, str) and role else "?",
        label=label,
        text=text,
        calls=_calls(raw.get("tool_calls")),
    )
    return _cut(message, limit)


def _cut(message: Message, limit: int) -> Message:
    over = message.size - limit
    if over <= 0:
        return message
    calls = message.calls[: max(limit // 4, 0)]
    cut_calls = len(message.calls) - len(calls)
    room = max(limit - len(calls) - len(message.label), 0)
    text = message.text[:room]
    return dataclasses.replace(
        message, text=text, calls=calls, cut=len(message.text) - len(text) + cut_calls
    )


def clip_conversation(messages: Any, *, limit: int) -> tuple[list[Message], list[Message], int]:
    """Fit a conversation into ``limit`` characters.

    Each message is cut to a quarter of ``limit`` (its text first shown, the rest
    counted); then the first message and as many of the last messages as fit are kept,
    then more from the front while they fit.

    Returns:
        ``(head, tail, omitted)``: the messages shown from the start and from the end,
        and how many between them are not shown.
    """
    if messages is None:
        messages = []
    raw = messages if isinstance(messages, list) else [messages]
    shown = [_message(entry, max(limit // 4, 1)) for entry in raw]
    if sum(m.size for m in shown) <= limit:
        return shown, [], 0
    room = limit - shown[0].size
    start = 1
    end = len(shown)
    while end > start and shown[end - 1].size <= room:
        end -= 1
        room -= shown[end].size
    while start < end and shown[start].size <= room:
        room -= shown[start].size
        start += 1
    return shown[:start], shown[end:], end - start


def _read_samples(path: Path) -> Iterator[tuple[int, dict[str, Any] | None]]:
    """Yield ``(line number, object)`` for each line of ``samples.jsonl`` (None: unreadable)."""
    with path.open(encoding="utf-8", errors="replace") as file:
        for number, line in enumerate(file, start=1):
            try:
                data = json.loads(line)
            except ValueError:
                data = None
            yield number, data if isinstance(data, dict) else None


def _conversations(
    run_dir: Path, records: Mapping[Key, JournalRecord], notes: list[str]
) -> dict[Key, Conversation]:
    path = run_dir / "samples.jsonl"
    if not path.exists():
        # Only a server's result carries a sample: a run whose rollouts all failed before
        # one answered (status None) has no samples.jsonl, and nothing is missing.
        if any(record.status is not None for record in records.values()):
            notes.append("samples.jsonl is missing: no conversations to show")
        return {}
    wanted = {record.rollout_id: key for key, record in records.items()}
    limit = min(MAX_CONVERSATION_CHARS, CONVERSATION_BUDGET_CHARS // max(len(wanted), 1))
    found: dict[Key, Conversation] = {}
    unreadable: list[int] = []
    for number, data in _read_samples(path):
        if data is None:
            unreadable.append(number)
            continue
        rollout_id = data.get("rollout_id")
        key = wanted.get(rollout_id) if isinstance(rollout_id, str) else None
        if key is None:
            continue
        head, tail, omitted = clip_conversation(data.get("messages"), limit=limit)
        metrics = data.get("metrics")
        found[key] = Conversation(
            head=tuple(head),
            tail=tuple(tail),
            omitted=omitted,
            metrics=metrics if isinstance(metrics, dict) else {},
            line=number,
        )
    if unreadable:
        shown = ", ".join(map(str, unreadable[:10])) + (", ..." if len(unreadable) > 10 else "")
        lines = "line" if len(unreadable) == 1 else "lines"
        notes.append(
            f"{len(unreadable)} {lines} of samples.jsonl could not be read ({lines} {shown}); "
            "a line cut short by a crash is the usual cause"
        )
    return found


def _listed(keys: list[Key], latest: Mapping[Key, JournalRecord], threshold: float) -> list[Key]:
    """The items the report lists: all of them, or failures first up to the limit."""
    if len(keys) <= MAX_LISTED_ITEMS:
        return keys

    def rank(key: Key) -> int:
        record = latest.get(key)
        if record is not None and record.outcome in FAILED_OUTCOMES:
            return 0
        passed = (
            record is not None
            and record.outcome == "success"
            and (record.reward or 0.0) >= threshold
        )
        return 2 if passed else 1

    return sorted(sorted(keys, key=rank)[:MAX_LISTED_ITEMS])


def load_run(run_dir: Path) -> RunData:
    """Read a run directory for the report.

    Raises:
        EvalInputError: If ``run_dir`` is not a rollout-eval run (no readable manifest).
        JournalError: If the journal is corrupt.
    """
    manifest_path = run_dir / "manifest.json"
    if not manifest_path.exists():
        raise EvalInputError(
            f"{run_dir} is not a rollout-eval run directory (it has no manifest.json); name the "
            "OUTPUT/NAME directory that rollout-eval run wrote"
        )
    manifest = read_manifest(manifest_path)
    keys = _selected_items(manifest, manifest_path)
    journal = read_journal(run_dir / "events.jsonl")
    notes: list[str] = []
    previous = _previous_summary(run_dir / "summary.json", notes)
    threshold = (previous.get("pass") or {}).get("threshold")
    if not isinstance(threshold, int | float) or isinstance(threshold, bool):
        threshold = 1.0
        notes.append("the pass threshold is not recorded; the report uses 1.0")
    run_info = previous.get("run") if isinstance(previous.get("run"), dict) else None
    if run_info is None:
        run_info = {
            "name": run_dir.name,
            "dataset": manifest.dataset_path,
            "dataset_sha256": manifest.inputs.dataset_sha256,
            "rows": manifest.inputs.rows,
            "n": manifest.inputs.n,
            "server_url": manifest.server_url,
            "chat_url": manifest.chat_url,
            "chat_models": list(manifest.chat_models) if manifest.chat_models else None,
        }
    summary = summarize(
        journal, items=keys, n=manifest.inputs.n, pass_threshold=float(threshold), run=run_info
    )
    latest = latest_by_item(journal)
    final = tuple(latest[key] for key in keys if key in latest)
    listed = _listed(keys, latest, float(threshold))
    listed_records = {key: latest[key] for key in listed if key in latest}
    conversations = _conversations(run_dir, listed_records, notes)
    if len(keys) > MAX_LISTED_ITEMS:
        notes.append(
            f"the report lists {MAX_LISTED_ITEMS} of {len(keys)} items (failures first, then "
            "other items that did not pass, then passes); events.jsonl and samples.jsonl hold "
            "them all"
        )
    return RunData(
        run_dir=run_dir,
        manifest=manifest,
        summary=summary,
        items=tuple(
            Item(key=key, record=latest.get(key), conversation=conversations.get(key))
            for key in listed
        ),
        final_records=final,
        notes=tuple(notes),
    )
