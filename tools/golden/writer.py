"""Writing golden files: random values scrubbed to placeholders, one file per payload and
an ``index.json`` describing each."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from .inputs import LOGGER_NAME, REQUEST_HEADERS, RESPONSE_HEADERS
from .recording import Exchange

log = logging.getLogger(LOGGER_NAME)


def _reject_constant(name: str) -> Any:
    """``parse_constant`` hook: strict JSON has no NaN/Infinity literals."""
    raise ValueError(f"non-standard JSON constant {name}")


class GoldenWriter:
    """Writes scrubbed payload files and their ``index.json`` into one directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.index: dict[str, dict[str, Any]] = {}
        # real value -> (placeholder, names of the fields it stood for)
        self._replacements: dict[str, tuple[str, tuple[str, ...]]] = {}
        if directory.exists():
            shutil.rmtree(directory)
        directory.mkdir(parents=True)

    def replace(self, real: str, placeholder: str, kind: str) -> None:
        """Substitute ``placeholder`` for every occurrence of ``real`` from now on."""
        if real and real != placeholder:
            _, kinds = self._replacements.get(real, (placeholder, ()))
            if kind not in kinds:
                kinds = (*kinds, kind)
            self._replacements[real] = (placeholder, kinds)

    def _scrub(self, value: Any, used: dict[str, str]) -> Any:
        if isinstance(value, str):
            for real, (placeholder, kinds) in self._replacements.items():
                if real in value:
                    value = value.replace(real, placeholder)
                    used.update(dict.fromkeys(kinds, placeholder))
            return value
        if isinstance(value, dict):
            return {self._scrub(k, used): self._scrub(v, used) for k, v in value.items()}
        if isinstance(value, list):
            return [self._scrub(v, used) for v in value]
        return value

    def _write(
        self,
        name: str,
        body: Any,
        *,
        kind: str,
        method: str,
        path: str,
        status: int | None,
        headers: dict[str, str],
        interest: tuple[str, ...],
        source: str,
        description: str,
        request_body: Any = None,
    ) -> None:
        if name in self.index:
            raise ValueError(f"{name} written twice")
        used: dict[str, str] = {}
        body = self._scrub(body, used)
        entry: dict[str, Any] = {
            "method": method,
            "path": self._scrub(path, used),
            "status": status,
            "headers_of_interest": self._scrub(
                {h: headers[h] for h in interest if h in headers}, used
            ),
            "kind": kind,
            "source": source,
            "description": description,
        }
        if request_body is not None:
            entry["request_body"] = self._scrub(request_body, used)
        if used:
            entry["placeholders"] = dict(sorted(used.items()))
        if name.endswith(".json"):
            text = json.dumps(body, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
        else:
            text = body  # non-JSON bodies are kept byte for byte, without a final newline
        for real in self._replacements:
            if real in text or real in json.dumps(entry):
                raise AssertionError(f"{name}: a random value escaped scrubbing")
        (self.directory / name).write_text(text, encoding="utf-8")
        self.index[name] = entry
        log.info("wrote %s", name)

    def response(
        self,
        name: str,
        exchange: Exchange,
        *,
        source: str,
        description: str,
        include_request: bool = False,
    ) -> None:
        """Write the response half of ``exchange``."""
        assert exchange.status is not None
        raw = bytes(exchange.response_body)
        body: Any
        if exchange.response_headers.get("content-type", "").startswith("application/json"):
            body = json.loads(raw)
        else:
            body = raw.decode("utf-8")
            name = name.removesuffix(".json") + ".txt"
        request_body: Any = None
        if include_request and exchange.request_body:
            try:
                request_body = json.loads(exchange.request_body, parse_constant=_reject_constant)
            except ValueError:  # not strict JSON: keep the text as sent
                request_body = exchange.request_body.decode("utf-8", errors="replace")
        self._write(
            name,
            body,
            kind="response",
            method=exchange.method,
            path=exchange.path,
            status=exchange.status,
            headers=exchange.response_headers,
            interest=RESPONSE_HEADERS,
            source=source,
            description=description,
            request_body=request_body,
        )

    def request(
        self, name: str, exchange: Exchange, *, source: str, description: str, body: Any = None
    ) -> None:
        """Write the request half of ``exchange`` (its JSON body, or ``body``)."""
        if body is None:
            body = json.loads(exchange.request_body)
        self._write(
            name,
            body,
            kind="request",
            method=exchange.method,
            path=exchange.path,
            status=None,
            headers=exchange.request_headers,
            interest=REQUEST_HEADERS,
            source=source,
            description=description,
        )

    def finish(self) -> None:
        text = json.dumps(
            dict(sorted(self.index.items())), indent=2, ensure_ascii=False, allow_nan=False
        )
        (self.directory / "index.json").write_text(text + "\n", encoding="utf-8")
        log.info("wrote index.json (%d entries) in %s", len(self.index), self.directory)
