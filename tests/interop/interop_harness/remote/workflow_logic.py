"""The interop workflow and grader, in the standard library only.

Both peers' servers run this logic (``ours_app`` adapts it to ``rollout_server``,
``osmosis_app`` to ``osmosis_ai.rollout``), so a scenario means the same thing on both
sides. It mirrors the example workflow: the agent asks the chat-completions endpoint the
request names (``chat_completions_url``, which the test's stand-in serves) for an answer,
returns the conversation, and the grader rewards 1.0 when the answer equals the label.

``metadata`` steers the failure scenarios:

* ``{"fail": "value"}``: the workflow raises ``ValueError("interop: bad value")``
  (``validation_error``); ``{"fail": "runtime"}`` raises ``RuntimeError`` (``agent_error``);
* ``{"grade_gate_url": URL}``: the grader first POSTs to ``URL`` and waits for the answer,
  so a test can hold a rollout in ``grading``.

Everything here is run inside the peer's interpreter; it imports nothing from the test suite.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import urlsplit

READ_LIMIT_BYTES = 1 << 20


async def post_json(url: str, payload: dict[str, Any], *, api_key: str | None = None) -> Any:
    """POST ``payload`` to ``url`` over HTTP/1.1 and return the decoded JSON answer.

    Raises:
        RuntimeError: If the answer is not 200.
    """
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None:
        raise ValueError(f"interop: only http:// endpoints are supported; got {url!r}")
    body = json.dumps(payload).encode()
    path = parts.path or "/"
    headers = [
        f"POST {path} HTTP/1.1",
        f"Host: {parts.netloc}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
    ]
    if api_key:
        headers.append(f"Authorization: Bearer {api_key}")
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80)
    try:
        writer.write(("\r\n".join(headers) + "\r\n\r\n").encode() + body)
        await writer.drain()
        raw = await reader.read(-1)
    finally:
        writer.close()
    head, _, content = raw.partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0].decode("latin-1")
    status = int(status_line.split()[1]) if len(status_line.split()) > 1 else 0
    if status != 200:
        raise RuntimeError(f"interop: {url} answered HTTP {status}")
    return json.loads(content)


async def run_agent(
    prompt: list[dict[str, Any]],
    metadata: dict[str, Any] | None,
    chat_completions_url: str,
    llm_api_key: str | None,
) -> list[dict[str, Any]]:
    """Run the interop agent once: one chat completion, appended to the prompt."""
    fail = (metadata or {}).get("fail")
    if fail == "value":
        raise ValueError("interop: bad value")
    if fail == "runtime":
        raise RuntimeError("interop: boom")
    answer = await post_json(
        chat_completions_url.rstrip("/") + "/chat/completions",
        {"model": "interop", "messages": prompt},
        api_key=llm_api_key,
    )
    message = answer["choices"][0]["message"]
    return [*prompt, {"role": "assistant", "content": message["content"]}]


async def grade(messages: list[dict[str, Any]], label: str | None, metadata: Any) -> float:
    """The reward: 1.0 when the last assistant message equals the label, else 0.0."""
    gate = (metadata or {}).get("grade_gate_url") if isinstance(metadata, dict) else None
    if gate:
        await post_json(gate, {"phase": "grading"})
    answers = [m.get("content") for m in messages if m.get("role") == "assistant"]
    if not answers or label is None:
        return 0.0
    return 1.0 if str(answers[-1]).strip() == label.strip() else 0.0
