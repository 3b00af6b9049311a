"""Reading and validating an evaluation dataset (JSONL or CSV), and selecting its rows.

A row has these fields; any other field is ignored:

* ``system_prompt`` (optional string): becomes the first, ``system`` message;
* ``user_prompt`` (string): the ``user`` message; required unless ``metadata`` is given;
* ``label`` (string; alias ``ground_truth``): what the grader compares with; required
  unless ``metadata`` is given. JSON numbers are accepted and kept as their JSON text
  (``42`` becomes ``"42"``);
* ``metadata`` (a JSON object, or a string holding one): passed to the server as is;
  ``{}`` and empty cells count as absent.

Every row is validated before any rollout starts; all problems found are reported
together, each naming the file, the line and the field.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final

from ._errors import DatasetError, EvalInputError, RowIssue

__all__ = [
    "MAX_REPORTED_ISSUES",
    "Dataset",
    "DatasetRow",
    "load_dataset",
    "parse_row_selection",
]

MAX_REPORTED_ISSUES: Final = 20
"""At most this many row problems are listed in one :class:`DatasetError`."""

_FORMATS: Final = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv"}
_PROMPT_LOOKALIKES: Final = ("prompt", "question", "input", "query", "user")
_LABEL_LOOKALIKES: Final = ("answer", "target", "expected", "solution", "output")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DatasetRow:
    """One validated dataset row.

    ``index`` is the row's 0-based position among the dataset's rows (what ``--rows``
    selects and what the journal records as ``row_index``); ``line`` is the 1-based line
    of the file where the row starts.
    """

    index: int
    line: int
    system_prompt: str | None
    user_prompt: str | None
    label: str | None
    metadata: dict[str, Any] | None

    @property
    def initial_messages(self) -> list[dict[str, Any]]:
        """The chat messages the rollout starts from (system if any, then user if any)."""
        messages: list[dict[str, Any]] = []
        if self.system_prompt is not None:
            messages.append({"role": "system", "content": self.system_prompt})
        if self.user_prompt is not None:
            messages.append({"role": "user", "content": self.user_prompt})
        return messages


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Dataset:
    """A whole validated dataset: its rows, format and the SHA-256 of its bytes."""

    path: Path
    format: str
    sha256: str
    rows: tuple[DatasetRow, ...]


class _Issues:
    """Collects row problems; stops listing after :data:`MAX_REPORTED_ISSUES`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.items: list[RowIssue] = []
        self.count = 0
        self.lines: set[int] = set()

    def add(self, line: int, field: str | None, message: str) -> None:
        self.count += 1
        self.lines.add(line)
        if len(self.items) < MAX_REPORTED_ISSUES:
            self.items.append(RowIssue(path=self.path, line=line, field=field, message=message))

    def raise_if_any(self) -> None:
        if not self.count:
            return
        more = self.count - len(self.items)
        message = (
            f"dataset {self.path} has {_plural(self.count, 'problem')} in "
            f"{_plural(len(self.lines), 'row')}"
        )
        if more:
            message += f" (the first {len(self.items)} are listed)"
        message += "; fix these rows (see `rollout-eval run --help` for the row format):"
        raise DatasetError(message, self.items)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def load_dataset(path: str | Path) -> Dataset:
    """Read and validate a JSONL (``.jsonl``/``.ndjson``) or CSV (``.csv``) dataset.

    Args:
        path: The dataset file. Its suffix chooses the format.

    Returns:
        The validated dataset.

    Raises:
        DatasetError: If the file is missing, unreadable, of an unknown format, empty, or
            has invalid rows (every problem is listed, with file, line and field).
    """
    file = Path(path)
    shown = str(path)
    fmt = _FORMATS.get(file.suffix.lower())
    if fmt is None:
        raise DatasetError(
            f"dataset {shown}: unsupported format {file.suffix or '(no suffix)'!r}; "
            "use a .jsonl (one JSON object per line) or .csv (with a header row) file"
        )
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise DatasetError(f"dataset {shown} does not exist; check the path") from None
    except IsADirectoryError:
        raise DatasetError(f"dataset {shown} is a directory; name a .jsonl or .csv file") from None
    except OSError as exc:
        raise DatasetError(f"dataset {shown} cannot be read: {exc.strerror or exc}") from None
    issues = _Issues(shown)
    records = _jsonl_records(data, issues) if fmt == "jsonl" else _csv_records(data, issues)
    rows: list[DatasetRow] = []
    for line, record in records:
        row = _validate(record, line=line, index=len(rows), issues=issues)
        if row is not None:
            rows.append(row)
    issues.raise_if_any()
    if not rows:
        raise DatasetError(f"dataset {shown} has no rows; add at least one row")
    return Dataset(path=file, format=fmt, sha256=hashlib.sha256(data).hexdigest(), rows=tuple(rows))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (use a finite number or a string)")


def _jsonl_records(data: bytes, issues: _Issues) -> Iterator[tuple[int, Mapping[str, Any]]]:
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            issues.add(number, None, f"not valid UTF-8 (byte {exc.start + 1} of the line)")
            continue
        if not text.strip():
            continue
        try:
            value = json.loads(text, parse_constant=_reject_constant)
        except json.JSONDecodeError as exc:
            issues.add(number, None, f"not valid JSON: {exc.msg} (column {exc.colno})")
            continue
        except ValueError as exc:
            issues.add(number, None, str(exc))
            continue
        if not isinstance(value, dict):
            issues.add(number, None, f"expected a JSON object per line, got {_json_kind(value)}")
            continue
        yield number, value


def _csv_records(data: bytes, issues: _Issues) -> Iterator[tuple[int, Mapping[str, Any]]]:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        issues.add(line, None, "not valid UTF-8; save the CSV file as UTF-8")
        return
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        header = reader.fieldnames
    except csv.Error as exc:
        issues.add(1, None, f"unreadable CSV header: {exc}")
        return
    if not header:
        return
    names = [name.strip() for name in header]
    if "user_prompt" not in names and "metadata" not in names:
        issues.add(1, None, "the header has no 'user_prompt' (or 'metadata') column")
        return
    reader.fieldnames = names
    start = reader.line_num + 1
    while True:
        try:
            record = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            issues.add(start, None, f"unreadable CSV: {exc}")
            return
        line, start = start, reader.line_num + 1
        extra = record.pop(None, None)
        if extra:
            cells = len(names) + len(extra)
            issues.add(
                line, None, f"the row has {cells} cells but the header has {len(names)} columns"
            )
            continue
        cleaned = {key: (None if value in (None, "") else value) for key, value in record.items()}
        if all(value is None for value in cleaned.values()):
            continue
        yield line, cleaned


def _json_kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _optional_text(
    record: Mapping[str, Any], field: str, line: int, issues: _Issues
) -> tuple[bool, str | None]:
    value = record.get(field)
    if value is None or value == "":
        return True, None
    if not isinstance(value, str):
        issues.add(line, field, f"must be a string, got {_json_kind(value)}")
        return False, None
    return True, value


def _label_value(
    record: Mapping[str, Any], field: str, line: int, issues: _Issues
) -> tuple[bool, str | None]:
    value = record.get(field)
    if value is None or value == "":
        return True, None
    if isinstance(value, str):
        return True, value
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return True, json.dumps(value)
    issues.add(line, field, f"must be a string (or a number), got {_json_kind(value)}")
    return False, None


def _metadata_value(
    record: Mapping[str, Any], line: int, issues: _Issues
) -> tuple[bool, dict[str, Any] | None]:
    value = record.get("metadata")
    if value is None or value == "":
        return True, None
    if isinstance(value, str):
        try:
            value = json.loads(value, parse_constant=_reject_constant)
        except json.JSONDecodeError as exc:
            issues.add(
                line, "metadata", f"is a string but not valid JSON: {exc.msg} (column {exc.colno})"
            )
            return False, None
        except ValueError as exc:
            issues.add(line, "metadata", str(exc))
            return False, None
    if not isinstance(value, dict):
        issues.add(
            line,
            "metadata",
            f"must be a JSON object (or a string holding one), got {_json_kind(value)}",
        )
        return False, None
    return True, value or None


def _validate(
    record: Mapping[str, Any], *, line: int, index: int, issues: _Issues
) -> DatasetRow | None:
    ok_system, system_prompt = _optional_text(record, "system_prompt", line, issues)
    ok_user, user_prompt = _optional_text(record, "user_prompt", line, issues)
    ok_label, label = _label_value(record, "label", line, issues)
    ok_truth, ground_truth = _label_value(record, "ground_truth", line, issues)
    ok_meta, metadata = _metadata_value(record, line, issues)
    if not (ok_system and ok_user and ok_label and ok_truth and ok_meta):
        return None
    if label is not None and ground_truth is not None and label != ground_truth:
        issues.add(
            line,
            "ground_truth",
            f"is {ground_truth!r} but 'label' is {label!r}; they are aliases, keep one of them",
        )
        return None
    label = label if label is not None else ground_truth
    if user_prompt is None and metadata is None:
        issues.add(
            line,
            "user_prompt",
            "is missing (and there is no metadata)" + _hint(record, _PROMPT_LOOKALIKES),
        )
        return None
    if label is None and metadata is None:
        issues.add(
            line,
            "label",
            "is missing (and there is no metadata): the grader needs a label (or ground_truth) to "
            "compare with" + _hint(record, _LABEL_LOOKALIKES),
        )
        return None
    return DatasetRow(
        index=index,
        line=line,
        system_prompt=system_prompt,
        user_prompt=user_prompt,
        label=label,
        metadata=metadata,
    )


def _hint(record: Mapping[str, Any], lookalikes: tuple[str, ...]) -> str:
    for name in lookalikes:
        if record.get(name) not in (None, ""):
            return f"; the row has a {name!r} field: rename it"
    return ""


def parse_row_selection(spec: str, row_count: int) -> tuple[int, ...]:
    """Parse ``--rows`` (e.g. ``"3,7,10-20"``: 0-based row positions, ranges inclusive).

    Args:
        spec: Comma-separated row numbers and ``A-B`` ranges.
        row_count: How many rows the dataset has.

    Returns:
        The selected row positions, sorted, without duplicates.

    Raises:
        EvalInputError: If the spec is empty, malformed, or names a row the dataset lacks.
    """
    selected: set[int] = set()
    last = row_count - 1
    parts = [part.strip() for part in spec.split(",")]
    if not any(parts):
        raise EvalInputError("--rows is empty; give row numbers such as '0,3,10-20' (0-based)")
    for part in parts:
        if not part:
            continue
        first_text, dash, last_text = part.partition("-")
        try:
            first = int(first_text)
            end = int(last_text) if dash else first
        except ValueError:
            raise EvalInputError(
                f"--rows: {part!r} is not a row number or a range like '10-20' (0-based, inclusive)"
            ) from None
        if first < 0 or end < 0:
            raise EvalInputError(f"--rows: {part!r}: row numbers start at 0")
        if end < first:
            raise EvalInputError(f"--rows: {part!r}: a range must go from low to high")
        if end > last:
            raise EvalInputError(
                f"--rows: row {end} is out of range: the dataset has {row_count} rows (0-{last})"
            )
        selected.update(range(first, end + 1))
    return tuple(sorted(selected))
