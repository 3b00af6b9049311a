"""The evaluation runner: every (row, repetition) of a dataset through a rollout server
(or several, through one :class:`~rollout_client.RolloutClientPool`).

:func:`run_eval` does what ``rollout-eval run`` does:

1. Validate the dataset and the options (before any network access or file change).
2. Ask the chat endpoint which models it serves, and, when items are to run, each
   server's ``/health`` for its capacity; their sum is the default concurrency
   (:mod:`._probe`). A check that fails leaves no file behind.
3. Open (or create, or with ``fresh`` archive and re-create) ``OUTPUT/NAME/``: refuse to
   resume when the inputs changed (:mod:`._rundir`, :mod:`._manifest`).
4. Run the pending work items (:mod:`._scheduler`), at most ``concurrency`` in flight,
   appending every terminal outcome to the journal (:mod:`._recorder`; what each ending
   means is in :mod:`._outcomes`).
5. Write ``summary.json`` and return it.

After ``max_consecutive_infra_failures`` infrastructure failures in a row the run stops
early: no new rollouts start, the in-flight ones are cancelled on the server and stay
pending, and the report says why. An interruption (:meth:`RunControl.request_stop`, called
by the first Ctrl-C of the CLI) does the same. A server that is shutting down (``503`` on
admission; with several servers, none admits and one of them is shutting down) drains the
run: no new rollouts start, the in-flight ones are collected, the rest stays pending. A
run that ends with pending items says so in :attr:`EvalReport.closing_line` and exits 1
(130 when interrupted).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, TextIO

from ._client_seam import ClientFactory, RunClient, default_client_factory
from ._control import RunControl
from ._dataset import Dataset, load_dataset, parse_row_selection
from ._errors import EXIT_INCOMPLETE, EXIT_INTERRUPTED, EXIT_OK
from ._journal import DONE_OUTCOMES, Journal, JournalRecord, latest_by_item, read_journal
from ._manifest import format_rows
from ._options import EvalOptions
from ._probe import choose_concurrency, fetch_chat_models, probe_servers
from ._progress import Progress, ProgressLogHandler, routed_logging
from ._recorder import Recorder, preload_progress
from ._rundir import (
    JOURNAL_FILE,
    MANIFEST_FILE,
    SAMPLES_FILE,
    SUMMARY_FILE,
    prepare_run_dir,
    run_manifest,
)
from ._scheduler import Scheduler
from ._summary import build_summary, format_summary, write_summary

__all__ = ["EvalReport", "run_eval"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EvalReport:
    """What a run produced.

    Attributes:
        run_dir: ``OUTPUT/NAME``.
        summary: The summary document (also in ``summary.json``).
        exit_code: 0 when every item is done, 1 when items stay pending (stopped early),
            130 when interrupted.
        stop_reason: Why the run stopped before finishing, or None.
        summary_text: The printed table.
        closing_line: What to do next when items stay pending (or the run was
            interrupted): ``"rollout-eval: <why>; N items pending. Re-run the same command
            to resume."``; None when the run is complete.

    .. versionchanged:: 0.2
       ``closing_line``.
    """

    run_dir: Path
    summary: dict[str, Any]
    exit_code: int
    stop_reason: str | None
    summary_text: str
    closing_line: str | None = None


async def run_eval(
    options: EvalOptions,
    *,
    stream: TextIO,
    control: RunControl | None = None,
    client_factory: ClientFactory | None = None,
) -> EvalReport:
    """Run (or resume) one evaluation; see the module docstring.

    Args:
        options: The run's options.
        stream: Where progress and messages go (normally stderr); the summary table is
            returned in the report, not written here.
        control: Lets the caller stop the run (the CLI's Ctrl-C); default: a private one.
        client_factory: Builds the rollout client; called with ``url`` (or ``urls`` when
            there are extra servers), ``api_key`` and ``admission_timeout_sec``; default
            :class:`~rollout_client.RolloutClient` (:class:`~rollout_client.RolloutClientPool`
            for ``urls``).

    Returns:
        The report: run directory, summary, exit code and stop reason.

    Raises:
        EvalInputError: For invalid options, a bad dataset (file, line, field), a run
            whose inputs changed, or an unusable run directory.
        JournalError: When the journal is corrupt or another process holds the run.
        ServerUnavailableError: When the rollout server cannot be used.

    While it runs, a process that has not configured logging (no handler on the root
    logger) has its WARNING and worse records written to ``stream`` as
    ``rollout-eval: LEVEL logger: message`` lines that never garble the progress bar.
    """
    with routed_logging(stream) as log_handler:
        return await _run_eval(
            options,
            stream=stream,
            control=control or RunControl(),
            factory=client_factory or default_client_factory,
            log_handler=log_handler,
        )


async def _run_eval(
    options: EvalOptions,
    *,
    stream: TextIO,
    control: RunControl,
    factory: ClientFactory,
    log_handler: ProgressLogHandler | None,
) -> EvalReport:
    options.validate()
    dataset = load_dataset(options.dataset)
    selected = (
        parse_row_selection(options.rows, len(dataset.rows))
        if options.rows is not None
        else tuple(range(len(dataset.rows)))
    )
    items = [(row, run) for row in selected for run in range(options.n)]
    lookup = await fetch_chat_models(options.chat_url, options.llm_api_key)
    warning = lookup.warning(options.chat_url, options.llm_api_key)
    if warning is not None:
        stream.write(f"rollout-eval: warning: {warning}\n")
    chat_models = lookup.models
    # The start-up checks come before any file is written: a run that cannot start leaves
    # nothing behind (no run directory whose manifest the next attempt would compare with).
    healths = await probe_servers(factory, options) if _may_have_pending(options, items) else None
    manifest = run_manifest(options, dataset, selected, chat_models)
    run_dir, warnings = prepare_run_dir(options, manifest, stream)
    for warning in warnings:
        stream.write(f"rollout-eval: warning: {warning}\n")
    run_info: dict[str, Any] = {
        "name": options.run_name,
        "dataset": str(options.dataset),
        "dataset_sha256": dataset.sha256,
        "rows": format_rows(selected),
        "n": options.n,
        "server_url": options.server_url,
        **({"server_urls": list(options.server_urls)} if options.extra_server_urls else {}),
        "chat_url": options.chat_url,
        "chat_models": list(chat_models) if chat_models is not None else None,
    }
    with Journal(run_dir / JOURNAL_FILE) as journal:
        latest = latest_by_item(journal.records)
        pending = [item for item in items if _pending(latest.get(item))]
        mode = Progress.resolve_mode(options.progress, stream)
        progress = Progress(
            total=len(items), stream=stream, mode=mode, interval_sec=options.progress_interval_sec
        )
        if log_handler is not None:
            log_handler.progress = progress
        done_before = [latest[item] for item in items if not _pending(latest.get(item))]
        preload_progress(progress, done_before, pass_threshold=options.pass_threshold)
        if done_before:
            stream.write(
                f"rollout-eval: resuming run {options.run_name!r}: {len(done_before)} of "
                f"{len(items)} items done, {len(pending)} to run\n"
            )
        cancelled: frozenset[tuple[int, int]] = frozenset()
        if pending:
            concurrency, cancelled = await _run_pending(
                options=options,
                dataset=dataset,
                journal=journal,
                progress=progress,
                control=control,
                factory=factory,
                pending=pending,
                run_dir=run_dir,
                healths=healths,
            )
            run_info["concurrency"] = concurrency
            progress.close()
        records = list(journal.records)
    run_info["stopped"] = control.reason
    summary = build_summary(
        records,
        items=items,
        n=options.n,
        pass_threshold=options.pass_threshold,
        run=run_info,
        cancelled=cancelled,
    )
    text = _write_reports(run_dir, summary)
    if control.interrupted:
        exit_code = EXIT_INTERRUPTED
    elif summary["complete"]:
        exit_code = EXIT_OK
    else:
        exit_code = EXIT_INCOMPLETE
    return EvalReport(
        run_dir=run_dir,
        summary=summary,
        exit_code=exit_code,
        stop_reason=control.reason,
        summary_text=text,
        closing_line=_closing_line(summary, control),
    )


def _pending(record: JournalRecord | None) -> bool:
    return record is None or record.outcome not in DONE_OUTCOMES


def _may_have_pending(options: EvalOptions, items: list[tuple[int, int]]) -> bool:
    """Whether the run will start rollouts, read before the run directory is touched (the
    journal is read again, under its lock, once the run is opened).

    False only when the run exists and its journal has every item done, or when
    ``--resume`` names no run (opening it then fails with the clearer message).
    """
    run_dir = options.output / options.run_name
    journal = run_dir / JOURNAL_FILE
    exists = (run_dir / MANIFEST_FILE).exists() or journal.exists()
    if options.mode == "fresh":
        return True
    if not exists:
        return options.mode != "resume"
    if not journal.exists():
        return True
    latest = latest_by_item(read_journal(journal))
    return any(_pending(latest.get(item)) for item in items)


def _closing_line(summary: dict[str, Any], control: RunControl) -> str | None:
    """Why items stay pending and how to resume them; None for a complete run."""
    pending = summary["items"]["pending"]
    if not pending and not control.interrupted:
        return None
    if control.interrupted:
        why = "interrupted"
    elif control.reason is not None:
        why = control.reason
    else:
        failures = summary["infra_failures"]["pending_items"]
        why = f"{failures} items ended in an infrastructure failure (see the summary)"
    return f"rollout-eval: {why}; {pending} items pending. Re-run the same command to resume."


def _write_reports(run_dir: Path, summary: dict[str, Any]) -> str:
    """Write ``summary.json``; return the summary table, which lists the run's files."""
    write_summary(run_dir / SUMMARY_FILE, summary)
    files = [run_dir / name for name in (SUMMARY_FILE, JOURNAL_FILE, SAMPLES_FILE)]
    return format_summary(summary, files=[str(path) for path in files if path.exists()])


async def _run_pending(
    *,
    options: EvalOptions,
    dataset: Dataset,
    journal: Journal,
    progress: Progress,
    control: RunControl,
    factory: ClientFactory,
    pending: list[tuple[int, int]],
    run_dir: Path,
    healths: list[dict[str, Any]] | None,
) -> tuple[int, frozenset[tuple[int, int]]]:
    """Schedule the pending items (probing the servers first unless ``healths`` holds their
    ``/health`` answers); return the concurrency used and the items the run cancelled."""
    urls = options.server_urls
    if healths is None:
        healths = await probe_servers(factory, options)
    for url, health in zip(urls, healths, strict=True):
        if not isinstance(health.get("process_id"), str):
            progress.message(
                f"rollout-eval: warning: GET {url}/health has no process_id: is "
                "--server a rollout server (rollout-server serve, or osmosis-ai >= 0.3.5)?"
            )
    concurrency, note = choose_concurrency(options, healths, pending=len(pending))
    if note is not None:
        progress.message(note)
    admission = options.admission_timeout_sec or options.deadline_sec() * max(concurrency, 1)
    key = options.server_api_key
    if len(urls) == 1:
        client = factory(url=urls[0], api_key=key, admission_timeout_sec=admission)

        def cancel_client() -> RunClient:
            return factory(url=urls[0], api_key=key)
    else:
        client = factory(urls=urls, api_key=key, admission_timeout_sec=admission)

        def cancel_client() -> RunClient:
            return client  # only the pool knows which server admitted each rollout

    recorder = Recorder(
        journal=journal,
        progress=progress,
        control=control,
        samples_path=run_dir / SAMPLES_FILE,
        pass_threshold=options.pass_threshold,
        max_consecutive_infra_failures=options.max_consecutive_infra_failures,
    )
    scheduler = Scheduler(
        options=options,
        rows={row.index: row for row in dataset.rows},
        client=client,
        cancel_client_factory=cancel_client,
        control=control,
        recorder=recorder,
        progress=progress,
    )
    progress.message(
        f"rollout-eval: run {options.run_name!r}: {len(pending)} rollouts to run against "
        f"{', '.join(urls)}, {concurrency} at a time; results in {run_dir}"
    )
    try:
        progress.draw(force=True)
        await scheduler.run_items(pending, concurrency)
    finally:
        try:
            await scheduler.close()
        finally:
            await client.aclose()
    return concurrency, scheduler.cancelled_items()
