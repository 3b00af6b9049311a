"""A local stand-in for an OpenAI-compatible model server, for the demo and the tests.

**This is not a model.** It stands in for a real chat-completions server such as vLLM
or SGLang so that the demo and the tests run on a laptop in seconds, with no GPU and no
network. It speaks the same HTTP API (``POST /v1/chat/completions``, streaming and
non-streaming, with tool calls; ``GET /v1/models``) and "solves" the arithmetic questions
of ``examples/datasets/arithmetic.jsonl`` by rule:

1. It reads the last ``user`` message and turns it into an arithmetic expression
   (``"What is 17 * 23?"``, ``"the sum of 128 and 256"``, ``"15 percent of 240"``, a few
   word-problem templates).
2. If the request offers a function tool (``calculator`` preferred, else the first one) and
   no tool result has come back yet, it answers with one tool call whose arguments are
   ``{"<first string parameter, normally 'expression'>": "17 * 23"}``
   (``finish_reason: "tool_calls"``).
3. When the last message is the ``tool`` result, it answers ``"The answer is 391."``
   (``finish_reason: "stop"``). Without tools it computes the answer itself, with the
   example agent's own calculator (``examples/calculator_agent/calculator.py``).

To make rewards vary it gives a wrong final answer with probability ``--error-rate``. The
decision is a pure function of ``(seed, question, how many times this process has
answered that question)``, so a fresh stand-in reproduces the same results in any
scheduling order, while repeated runs of one question (``rollout-eval --n K``) differ.
``--http-500-rate`` and ``--http-429-rate`` inject server errors and rate limiting, and
``--latency-ms`` adds a (jittered) delay to every response.

Token ids and logprobs, as vLLM returns them, when a request asks (for trainer-side tests):

* ``return_token_ids: true``: the response carries ``prompt_token_ids`` (top level; in the
  first chunk of a stream) and ``choices[0].token_ids`` (in each chunk, the ids of that
  chunk's delta);
* ``logprobs: true``: ``choices[0].logprobs.content`` holds one entry per completion token
  (``{"token", "logprob", "bytes", "top_logprobs": []}``); with
  ``return_tokens_as_token_ids: true`` each ``token`` is ``"token_id:<id>"``.

The "tokenizer" is a toy (words, punctuation and runs of white space, each hashed to an id
below :data:`VOCAB_SIZE`) applied to a fixed rendering of the chat (:func:`render_prompt`);
the completion's tokens are those of its streamed pieces, in order, whether the call
streams or not. Logprobs are a pure function of the seed, the prompt and the position, so
one request always gets the same numbers. With ``--weight-version V`` every response also
reports ``"metadata": {"weight_version": V}`` (as SGLang does). :func:`produced` lists what
was returned to the requests that asked, for tests to compare against.

Run it::

    python tools/chat_standin/server.py --host 127.0.0.1 --port 0 --port-file /tmp/p \\
        --error-rate 0.1 --latency-ms 20 --seed 0

and point agents at ``http://127.0.0.1:<port>/v1`` (they call ``.../chat/completions``).
SIGTERM or SIGINT stops it cleanly (exit 0).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

# The stand-in's modules sit beside this file: found when it runs as a script, and added
# here for a caller that loads this file by path (the tests, tools/demo.py).
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.append(_HERE)

from aiohttp import web  # noqa: E402
from standin_answers import question_to_expression  # noqa: E402
from standin_http import MODEL_ID, StandinConfig, create_app, produced  # noqa: E402
from standin_tokens import VOCAB_SIZE, render_prompt, tokenize  # noqa: E402

__all__ = [
    "MODEL_ID",
    "VOCAB_SIZE",
    "StandinConfig",
    "create_app",
    "main",
    "produced",
    "question_to_expression",
    "render_prompt",
    "serve",
    "tokenize",
]


def _write_port_file(path: Path, port: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{port}\n", encoding="utf-8")
    tmp.replace(path)


async def serve(config: StandinConfig, *, host: str, port: int, port_file: Path | None) -> None:
    """Serve until SIGTERM or SIGINT; write the bound port to ``port_file`` once listening."""
    runner = web.AppRunner(create_app(config), handle_signals=False, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1]
        if port_file is not None:
            _write_port_file(port_file, bound)
        print(f"chat stand-in listening on http://{host}:{bound}/v1", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()
        print("chat stand-in stopping", flush=True)
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    """Command line: see ``--help``."""
    parser = argparse.ArgumentParser(
        description="Local OpenAI-compatible chat-completions stand-in (NOT a model: a rule-based "
        "stand-in for vLLM/SGLang that answers arithmetic questions with tool calls)."
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, default=0, help="port to bind; 0 picks a free one (default 0)"
    )
    parser.add_argument(
        "--port-file", type=Path, help="write the bound port to this file once listening"
    )
    parser.add_argument(
        "--error-rate", type=float, default=0.0, help="probability of a wrong final answer"
    )
    parser.add_argument(
        "--http-500-rate", type=float, default=0.0, help="probability of an HTTP 500 answer"
    )
    parser.add_argument(
        "--http-429-rate", type=float, default=0.0, help="probability of an HTTP 429 answer"
    )
    parser.add_argument(
        "--latency-ms", type=float, default=0.0, help="mean added delay per response, ms"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of every random decision (default 0)"
    )
    parser.add_argument(
        "--weight-version",
        metavar="V",
        help="report this weights version in every response (metadata.weight_version)",
    )
    parser.add_argument(
        "--api-key-env",
        metavar="NAME",
        help="require 'Authorization: Bearer $NAME' on every request",
    )
    args = parser.parse_args(argv)
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            parser.error(f"--api-key-env {args.api_key_env}: that environment variable is not set")
    try:
        config = StandinConfig(
            error_rate=args.error_rate,
            http_500_rate=args.http_500_rate,
            http_429_rate=args.http_429_rate,
            latency_ms=args.latency_ms,
            seed=args.seed,
            api_key=api_key,
            weight_version=args.weight_version,
        )
    except ValueError as exc:
        parser.error(str(exc))
    asyncio.run(serve(config, host=args.host, port=args.port, port_file=args.port_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
