"""The ``rollout-eval`` command.

``rollout-eval run DATASET --server URL --chat-url URL [options]`` drives every row of a
dataset (``--n`` times) through a rollout server (``--server`` repeated: several servers,
through a ``RolloutClientPool``) and writes ``OUTPUT/NAME/``:

* ``manifest.json``: the fingerprint of the inputs (resuming with other inputs is refused);
* ``events.jsonl``: the append-only, fsynced journal (the resume authority): one line per
  final outcome of an item and one per infrastructure failure (an attempt, run again on
  resume), so count only the lines whose ``outcome`` is ``success``, ``failed`` or
  ``skipped``;
* ``samples.jsonl``: the conversation and metrics of each recorded rollout that had a
  sample (the same rule tells final lines from attempts);
* ``summary.json``: counts by outcome, status and error category (with the most common
  error messages), reward mean and median, pass rate, pass@k (``--n`` > 1) and latency
  percentiles; also printed as a table;
* ``report.html`` with ``--report``: see ``rollout-eval report``.

Re-running the same command resumes: only pending items run. ``--fresh`` archives the old
run and starts over. Ctrl-C once stops starting rollouts, cancels the in-flight ones on
the server (they stay pending) and writes the summary; Ctrl-C twice exits at once.

``rollout-eval show RUN`` prints the summary table of a run again and lists its failures.
``rollout-eval report RUN`` writes ``report.html`` into the run directory: one
self-contained page (no network access needed) with the summary, charts, failures and
every item's final conversation. ``RUN`` is a run directory or a run name in ``--output``.

A run that ends with items pending ends with the line ``rollout-eval: <why>; N items
pending. Re-run the same command to resume.``: after Ctrl-C, after the stop rule
(``--max-consecutive-infra-failures`` in a row, e.g. a server that crashed), after a server
that is shutting down (it answers 503 to new rollouts: none start, the ones in flight are
collected; with several ``--server``, once none admits and one of them is shutting down),
or when some items ended in infrastructure failures.

Exit status: 0 when every item is done; 1 when items stay pending (the run stopped early
after infrastructure failures or a server shutting down, or the server could not be used);
2 for bad input (options, dataset, a changed run); 130 when interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final, TextIO

from rollout_types import PROTOCOL_VERSION

from .. import __version__
from ._control import RunControl
from ._errors import EXIT_INCOMPLETE, EXIT_INTERRUPTED, EvalError, EvalInputError
from ._failures import format_failures
from ._journal import latest_by_item, read_journal
from ._keys import EnvKey
from ._options import DEFAULT_MAX_CONSECUTIVE_INFRA_FAILURES, DEFAULT_OUTPUT_DIR, EvalOptions
from ._progress import PROGRESS_MODES, routed_logging
from ._runner import run_eval
from ._summary import format_summary
from .report import find_run_dir, write_report

__all__ = ["GC_YOUNG_THRESHOLD", "build_parser", "collector_tuned", "main"]

# Speed: benchmarks/README.md, "Client", row "`rollout-eval run` tunes the collector ..."
GC_YOUNG_THRESHOLD: Final = 10_000
"""Net container allocations between young-generation collections while a run goes on
(CPython's default is 700). With thousands of rollouts in flight, the default promotes
enough short-lived objects to trigger full collections that walk every live rollout: a
client receiving 5,000 results at once spent 0.73-0.75 s in the collector with the default
and 0.12-0.28 s with this value, and 0.41-0.45 ms of CPU per result against 0.21-0.31 ms."""

ROW_FORMAT_HELP: Final = """\
dataset rows (JSONL: one object per line; CSV: a header row):
  system_prompt  optional string: the first (system) message
  user_prompt    string: the user message (required unless metadata is given)
  label          string or number, alias ground_truth: what the grader compares with
                 (required unless metadata is given)
  metadata       JSON object, or a string holding one: passed to workflow and grader
other fields are ignored; every row is checked before any rollout starts.
"""


def _seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``rollout-eval``."""
    parser = argparse.ArgumentParser(
        prog="rollout-eval",
        description="Evaluate a dataset through a rollout server (rollout protocol, osmosis-ai "
        "0.3.x compatible).",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {__version__} (rollout protocol {PROTOCOL_VERSION})",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser(
        "run",
        help="run (or resume) an evaluation",
        description="Run every dataset row (--n times) through the rollout server; re-running "
        "the same command resumes. Ctrl-C once cancels in-flight rollouts on the server and "
        "keeps them pending; twice exits at once.",
        epilog=ROW_FORMAT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("dataset", type=Path, metavar="DATASET", help="a .jsonl or .csv file")
    run.add_argument(
        "--server",
        required=True,
        action="append",
        metavar="URL",
        help="rollout server base URL; repeat it for several servers (rollouts are spread "
        "over them, a server that fails is left out until it answers again)",
    )
    run.add_argument(
        "--chat-url",
        required=True,
        metavar="URL",
        help="OpenAI-compatible base URL of the model (e.g. http://127.0.0.1:8000/v1)",
    )
    run.add_argument(
        "--server-api-key-env",
        metavar="NAME",
        help="environment variable holding the rollout server's API key",
    )
    run.add_argument(
        "--llm-api-key-env",
        metavar="NAME",
        help="environment variable holding the chat endpoint's API key (sent as llm_api_key)",
    )
    run.add_argument(
        "--concurrency",
        type=int,
        metavar="N",
        help="most rollouts in flight (default: the capacity the server's /health reports)",
    )
    run.add_argument("--n", type=int, default=1, metavar="K", help="runs per row (default 1)")
    run.add_argument(
        "--rows", metavar="SPEC", help="rows to run, 0-based, e.g. 3,7,10-20 (default all)"
    )
    run.add_argument(
        "--agent-timeout-sec",
        type=_seconds,
        metavar="S",
        help="workflow budget per rollout (default: none)",
    )
    run.add_argument(
        "--grader-timeout-sec",
        type=_seconds,
        metavar="S",
        help="grader budget per rollout (default: none)",
    )
    run.add_argument(
        "--item-deadline-sec",
        type=_seconds,
        metavar="S",
        help="bound on one rollout from admission to result; it is then cancelled and counted "
        "as an infrastructure failure (default: agent + grader + 60 when both are set, else 3600)",
    )
    run.add_argument(
        "--output",
        type=Path,
        default=DEFAULT_OUTPUT_DIR,
        metavar="DIR",
        help=f"directory of runs (default {DEFAULT_OUTPUT_DIR})",
    )
    run.add_argument("--name", metavar="RUN", help="run name (default: the dataset file's stem)")
    mode = run.add_mutually_exclusive_group()
    mode.add_argument(
        "--resume", action="store_true", help="require an existing run and continue it"
    )
    mode.add_argument(
        "--fresh", action="store_true", help="archive an existing run of this name, start over"
    )
    run.add_argument(
        "--pass-threshold",
        type=float,
        default=1.0,
        metavar="X",
        help="a success passes when its reward >= X (default 1.0)",
    )
    run.add_argument(
        "--max-consecutive-infra-failures",
        type=int,
        default=DEFAULT_MAX_CONSECUTIVE_INFRA_FAILURES,
        metavar="N",
        help="stop early after N infrastructure failures in a row (default "
        f"{DEFAULT_MAX_CONSECUTIVE_INFRA_FAILURES}; 0 never stops)",
    )
    run.add_argument(
        "--progress",
        choices=PROGRESS_MODES,
        default="auto",
        help="bar on a terminal, plain lines otherwise (default auto)",
    )
    run.add_argument(
        "--progress-interval-sec",
        type=_seconds,
        default=10.0,
        metavar="S",
        help="seconds between plain progress lines (default 10)",
    )
    run.add_argument(
        "--report",
        action="store_true",
        help="also write report.html (see rollout-eval report) and print its path",
    )
    show = commands.add_parser(
        "show",
        help="print the summary of a run again, and its failures",
        description="Print the summary table of a run (from summary.json) and list its failed "
        "items: row, run, outcome, error category and message (from events.jsonl).",
    )
    report = commands.add_parser(
        "report",
        help="write the HTML report of a run",
        description="Write RUN_DIR/report.html: one self-contained page (viewing it needs no "
        "network access) with the summary, pass@k, the reward and latency distributions, the "
        "failures by category with their messages, and every item linked to its final "
        "conversation. Prints the report's path.",
    )
    for command in (show, report):
        command.add_argument(
            "run",
            metavar="RUN",
            help="a run directory (OUTPUT/NAME), or a run name in --output",
        )
        command.add_argument(
            "--output",
            type=Path,
            default=DEFAULT_OUTPUT_DIR,
            metavar="DIR",
            help=f"directory of runs, to find RUN by name (default {DEFAULT_OUTPUT_DIR})",
        )
    for command in commands.choices.values():  # main() names the subcommand in errors
        command.set_defaults(command_parser=command)
    return parser


def _env_key(flag: str, name: str | None) -> str | None:
    if name is None:
        return None
    value = os.environ.get(name)
    if value is None or not value.strip():
        raise EvalInputError(
            f"environment variable {name} (named by {flag}) is not set or blank; export the key "
            f"in it, or drop {flag}"
        )
    return EnvKey(value, env_name=name)


def options_from_args(args: argparse.Namespace) -> EvalOptions:
    """Build :class:`EvalOptions` from parsed ``run`` arguments.

    Raises:
        EvalInputError: When an API key variable is unset or an option is invalid.
    """
    options = EvalOptions(
        dataset=args.dataset,
        server_url=args.server[0],
        extra_server_urls=tuple(args.server[1:]),
        chat_url=args.chat_url,
        server_api_key=_env_key("--server-api-key-env", args.server_api_key_env),
        llm_api_key=_env_key("--llm-api-key-env", args.llm_api_key_env),
        concurrency=args.concurrency,
        n=args.n,
        rows=args.rows,
        agent_timeout_sec=args.agent_timeout_sec,
        grader_timeout_sec=args.grader_timeout_sec,
        output=args.output,
        name=args.name,
        mode="resume" if args.resume else "fresh" if args.fresh else "auto",
        pass_threshold=args.pass_threshold,
        max_consecutive_infra_failures=args.max_consecutive_infra_failures,
        item_deadline_sec=args.item_deadline_sec,
        progress=args.progress,
        progress_interval_sec=args.progress_interval_sec,
    )
    options.validate()
    return options


async def _run_command(options: EvalOptions, err: TextIO, out: TextIO) -> int:
    control = RunControl()
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    signals = 0

    def on_signal(signum: int) -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            err.write(
                f"\nrollout-eval: {signal.Signals(signum).name}: cancelling in-flight rollouts on "
                "the server (they stay pending); press Ctrl-C again to exit at once\n"
            )
            err.flush()
            control.request_stop(f"interrupted by {signal.Signals(signum).name}", interrupted=True)
        elif main_task is not None:
            main_task.cancel()

    installed: list[int] = []
    for wanted in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(wanted, on_signal, int(wanted))
            installed.append(int(wanted))
        except (NotImplementedError, RuntimeError):  # pragma: no cover - not on POSIX
            pass
    try:
        report = await run_eval(options, stream=err, control=control)
    finally:
        for number in installed:
            loop.remove_signal_handler(number)
    out.write(report.summary_text + "\n")
    out.flush()
    if report.closing_line is not None:
        err.write(report.closing_line + "\n")
    return report.exit_code


def _show(run: str, output: Path, out: TextIO) -> int:
    run_dir = find_run_dir(run, output)
    path = run_dir / "summary.json"
    try:
        summary: Any = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EvalInputError(
            f"{path} does not exist; name a run directory (OUTPUT/NAME) that rollout-eval wrote"
        ) from None
    except (OSError, ValueError) as exc:
        raise EvalInputError(f"{path} cannot be read: {exc}") from None
    out.write(format_summary(summary) + "\n")
    records = latest_by_item(read_journal(run_dir / "events.jsonl"))
    out.write(format_failures([records[key] for key in sorted(records)]) + "\n")
    return 0


# Speed: benchmarks/README.md, "Client", row "`rollout-eval run` tunes the collector ..."
@contextlib.contextmanager
def collector_tuned() -> Iterator[None]:
    """Tune CPython's cyclic collector for a run, and restore it afterwards.

    Everything alive on entry (modules, options, the dataset) is frozen out of the
    collector's reach, so full collections walk only the run's own objects, and the young
    generation is collected every :data:`GC_YOUNG_THRESHOLD` container allocations (the
    older generations' thresholds are kept). On exit the thresholds are restored and the
    frozen objects handed back to the collector, unless objects were frozen already on
    entry (the process manages freezing itself: its frozen set is left frozen).
    """
    before = gc.get_threshold()
    frozen_before = gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)
        if frozen_before == 0:
            gc.unfreeze()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``rollout-eval``; returns the exit status (see the module docstring)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's usage, not the top-level one argparse would print
        command: argparse.ArgumentParser = args.command_parser
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    err, out = sys.stderr, sys.stdout
    with routed_logging(err):  # log records of every step as rollout-eval lines
        return _dispatch(args, err, out)


def _dispatch(args: argparse.Namespace, err: TextIO, out: TextIO) -> int:
    """Run the parsed command; return the exit status."""
    try:
        if args.command == "show":
            return _show(args.run, args.output, out)
        if args.command == "report":
            out.write(f"{write_report(find_run_dir(args.run, args.output))}\n")
            return 0
        options = options_from_args(args)
        with collector_tuned():
            status = asyncio.run(_run_command(options, err, out))
        if args.report:
            out.write(f"report: {write_report(options.output / options.run_name)}\n")
        return status
    except EvalError as exc:
        err.write(f"rollout-eval: error: {exc}\n")
        return exc.exit_code
    except OSError as exc:
        err.write(f"rollout-eval: error: {exc}\n")
        return EXIT_INCOMPLETE
    except asyncio.CancelledError:
        err.write(
            "rollout-eval: interrupted twice: exited at once. Recorded outcomes are safe in the "
            "journal; rollouts still running on the server end when their polling lease "
            "expires. Re-run the same command to resume.\n"
        )
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        err.write("rollout-eval: interrupted\n")
        return EXIT_INTERRUPTED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
