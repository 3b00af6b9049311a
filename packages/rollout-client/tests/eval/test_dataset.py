"""Reading, validating and selecting dataset rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout_client.eval import DatasetError, EvalInputError, load_dataset, parse_row_selection
from rollout_client.eval._dataset import MAX_REPORTED_ISSUES


def jsonl(path: Path, *rows: object) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


class TestLoadJsonl:
    def test_valid_rows_become_messages_label_and_metadata(self, tmp_path: Path) -> None:
        """System and user prompts become messages; label, ground_truth and metadata are kept."""
        data = load_dataset(
            jsonl(
                tmp_path / "d.jsonl",
                {"system_prompt": "S", "user_prompt": "U", "label": "1", "extra": 5},
                {"user_prompt": "V", "ground_truth": 42},
                {"metadata": '{"task": "t"}'},
                "",
                {"user_prompt": "W", "label": "x", "metadata": {}},
            )
        )
        first, second, third, fourth = data.rows
        assert first.initial_messages == [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "U"},
        ]
        assert second.label == "42"
        assert third.metadata == {"task": "t"}
        assert third.initial_messages == []
        assert fourth.metadata is None
        assert [r.line for r in data.rows] == [1, 2, 3, 5]
        assert [r.index for r in data.rows] == [0, 1, 2, 3]
        assert data.format == "jsonl"
        assert len(data.sha256) == 64

    def test_every_bad_row_is_listed_with_file_line_and_field(self, tmp_path: Path) -> None:
        """All problems are reported together, each naming file, line and field."""
        path = jsonl(
            tmp_path / "bad.jsonl",
            {"user_prompt": "ok", "label": "1"},
            {"question": "q", "label": "1"},
            {"user_prompt": "u", "label": "1", "ground_truth": "2"},
            "[1, 2]",
            '{"user_prompt": "u", "label": NaN}',
            {"user_prompt": "u", "label": True},
            {"user_prompt": "u", "label": "1", "metadata": 3},
        )
        with pytest.raises(DatasetError) as caught:
            load_dataset(path)
        text = str(caught.value)
        assert "has 6 problems in 6 rows;" in text
        assert f"{path}:2: field 'user_prompt': is missing" in text
        assert "the row has a 'question' field: rename it" in text
        assert f"{path}:3: field 'ground_truth': is '2' but 'label' is '1'" in text
        assert f"{path}:4: expected a JSON object per line, got an array" in text
        assert f"{path}:5: NaN is not valid JSON" in text
        assert f"{path}:6: field 'label': must be a string (or a number), got a boolean" in text
        assert f"{path}:7: field 'metadata': must be a JSON object" in text
        assert [(i.line, i.field) for i in caught.value.issues][:2] == [
            (2, "user_prompt"),
            (3, "ground_truth"),
        ]

    def test_one_bad_row_is_counted_in_the_singular(self, tmp_path: Path) -> None:
        """One problem in one row reads "1 problem in 1 row", not "1 invalid problems"."""
        path = jsonl(tmp_path / "one.jsonl", {"user_prompt": "ok", "label": "1"}, {"label": "1"})
        with pytest.raises(DatasetError, match=r"has 1 problem in 1 row;"):
            load_dataset(path)

    def test_many_problems_are_capped(self, tmp_path: Path) -> None:
        """Only the first problems are listed, and the message says how many there are."""
        path = jsonl(tmp_path / "d.jsonl", *(["{oops"] * (MAX_REPORTED_ISSUES + 5)))
        with pytest.raises(
            DatasetError, match=rf"has {MAX_REPORTED_ISSUES + 5} problems in"
        ) as caught:
            load_dataset(path)
        assert len(caught.value.issues) == MAX_REPORTED_ISSUES

    @pytest.mark.parametrize(
        ("name", "content", "message"),
        [
            ("d.txt", "x", "unsupported format '.txt'"),
            ("missing.jsonl", None, "does not exist"),
            ("empty.jsonl", "\n\n", "has no rows"),
        ],
    )
    def test_unusable_files(
        self, tmp_path: Path, name: str, content: str | None, message: str
    ) -> None:
        """Unknown suffixes, missing and empty files are clear errors."""
        path = tmp_path / name
        if content is not None:
            path.write_text(content)
        with pytest.raises(DatasetError, match=message):
            load_dataset(path)

    def test_invalid_utf8_names_the_line(self, tmp_path: Path) -> None:
        """A line that is not UTF-8 is reported with its number."""
        path = tmp_path / "d.jsonl"
        path.write_bytes(b'{"user_prompt": "a", "label": "1"}\n{"user_prompt": "\xff"}\n')
        with pytest.raises(DatasetError, match=r"d.jsonl:2: not valid UTF-8"):
            load_dataset(path)


class TestLoadCsv:
    def test_valid_csv(self, tmp_path: Path) -> None:
        """CSV cells become fields; empty cells are absent; metadata cells are JSON."""
        path = tmp_path / "d.csv"
        path.write_text(
            'system_prompt,user_prompt,label,metadata\n,What?,7,\nS,Why?,8,"{""k"": 1}"\n'
        )
        rows = load_dataset(path).rows
        assert rows[0].system_prompt is None
        assert rows[0].label == "7"
        assert rows[1].metadata == {"k": 1}
        assert rows[1].line == 3

    def test_csv_without_prompt_column(self, tmp_path: Path) -> None:
        """A header without user_prompt (or metadata) is rejected on line 1."""
        path = tmp_path / "d.csv"
        path.write_text("question,answer\nq,1\n")
        with pytest.raises(DatasetError, match=r"d.csv:1: the header has no 'user_prompt'"):
            load_dataset(path)

    def test_csv_row_with_too_many_cells(self, tmp_path: Path) -> None:
        """A row with more cells than the header names its line."""
        path = tmp_path / "d.csv"
        path.write_text("user_prompt,label\nq,1\nq,1,extra\n")
        with pytest.raises(
            DatasetError, match=r"d.csv:3: the row has 3 cells but the header has 2"
        ):
            load_dataset(path)


class TestRowSelection:
    def test_ranges_and_numbers(self) -> None:
        """Numbers and inclusive ranges are merged, sorted and deduplicated."""
        assert parse_row_selection("3,7,1-4, 7", 10) == (1, 2, 3, 4, 7)

    @pytest.mark.parametrize(
        ("spec", "message"),
        [
            ("", "--rows is empty"),
            ("a", "is not a row number"),
            ("5-2", "from low to high"),
            ("0-10", "row 10 is out of range: the dataset has 10 rows"),
            ("-1", "is not a row number"),
        ],
    )
    def test_bad_selections(self, spec: str, message: str) -> None:
        """Malformed or out-of-range selections say what is wrong."""
        with pytest.raises(EvalInputError, match=message):
            parse_row_selection(spec, 10)
