"""How :class:`~rollout_server.ray._pool.WorkerPool` takes over the named workers of a
previous server process on the same state, and what they still hold.

* :func:`retire_extra_workers`: at the start, kill the named workers of the namespace
  beyond the pool's size.
* :func:`take_over`: the named worker at one position, if it serves (it outlived the
  previous server process); one that does not answer is killed.
* :func:`collect`: from every worker taken over, the replies of the rollouts the restarted
  server recovered that finished, and a dispatch for each still running (:func:`rewait`:
  it holds its worker's slot, waits on the worker's ``wait`` call, and its deadline runs).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from rollout_types import RolloutStatus

from .._logtext import get_logger
from ..observability._observer import NO_OBSERVER
from ._actors import WORKER_NAME, kill_actor, worker_name
from ._codec import decode_request
from ._dispatch import Dispatch, PoolWorker, describe_ray_error, when_done
from ._worker import Collected

__all__ = ["Replied", "collect", "retire_extra_workers", "rewait", "take_over"]

logger: Final = get_logger("rollout_server.ray_backend")

Replied = Callable[[Dispatch, concurrent.futures.Future[Any]], None]
"""The pool's callback when a dispatch's Ray call ends."""


def retire_extra_workers(namespace: str, size: int) -> int:
    """Kill the named workers of ``namespace`` at positions ``size`` and beyond; return how
    many were killed."""
    import ray

    retired = 0
    for entry in ray.util.list_named_actors(all_namespaces=True):
        match = WORKER_NAME.fullmatch(str(entry.get("name", "")))
        if entry.get("namespace") != namespace or match is None:
            continue
        if int(match.group(1)) >= size:
            with contextlib.suppress(Exception):
                kill_actor(ray.get_actor(entry["name"], namespace=namespace))
                retired += 1
    return retired


async def take_over(
    index: int, *, namespace: str, start_timeout_sec: float, fingerprint: str
) -> PoolWorker | None:
    """The named worker at ``index`` if it answers ``ready()`` within
    ``start_timeout_sec`` (marked ``reattached``, not yet serving), else None (one that does
    not answer is killed). A worker started with another spec than ``fingerprint`` is taken
    over all the same, with a warning."""
    import ray

    try:
        handle = ray.get_actor(worker_name(index), namespace=namespace)
    except ValueError:
        return None
    worker = PoolWorker(index, handle)
    try:
        async with asyncio.timeout(start_timeout_sec):
            worker.info = await handle.ready.remote()
    except Exception as exc:  # noqa: BLE001 - any failure: the worker is replaced
        logger.warning(
            "Ray worker %d of the previous server process does not answer (%s); replacing it",
            index,
            describe_ray_error(exc),
        )
        kill_actor(handle)
        return None
    worker.reattached = True
    logger.info("Ray %s outlived the previous server process: re-attached", worker.label)
    if worker.info.get("spec") != fingerprint:
        logger.warning(
            "Ray %s was started with another workflow, grader, config or artifact root "
            "than this server's (%s, not %s); it is re-attached to finish its rollouts and "
            "keeps serving with what it was started with: stop the server with SIGTERM "
            "(which stops the workers) to start them anew",
            worker.label,
            worker.info.get("spec"),
            fingerprint,
        )
    return worker


async def collect(
    workers: Sequence[PoolWorker],
    on_status: Mapping[str, Callable[[RolloutStatus], None]],
    *,
    loop: asyncio.AbstractEventLoop,
    grace_sec: float,
    lose: Callable[[PoolWorker, str], None],
    replied: Replied,
    expire: Callable[[Dispatch], None],
) -> tuple[dict[str, Any], dict[str, Dispatch]]:
    """Ask each of ``workers`` (taken over) what it holds of the rollouts of ``on_status``;
    a worker whose answer fails is lost (``lose``). Each rollout still running gets a
    dispatch (:func:`rewait`, with the pool's ``loop``, deadline grace, ``replied`` and
    ``expire`` callbacks); other rollouts still running there are cancelled by the
    worker (no server waits for them).

    Returns:
        ``(finished, running)``: ``run`` replies and dispatches, by rollout id.
    """
    ids = list(on_status)
    answers = await asyncio.gather(
        *(asyncio.wrap_future(w.handle.collect.remote(ids).future()) for w in workers),
        return_exceptions=True,
    )
    finished: dict[str, Any] = {}
    running: dict[str, Dispatch] = {}
    for worker, answer in zip(workers, answers, strict=True):
        worker.reattached = False
        if not isinstance(answer, Collected):
            cause = (
                describe_ray_error(answer)
                if isinstance(answer, BaseException)
                else f"collect() answered {type(answer).__name__}"
            )
            lose(worker, cause)
            continue
        if answer.cancelled:
            logger.warning(
                "Ray %s ran %d rollout(s) the restarted server does not wait for "
                "(published or forgotten meanwhile): cancelled",
                worker.label,
                answer.cancelled,
            )
        finished.update(answer.finished)
        for rollout_id, (key, payload, since, grading) in answer.running.items():
            running[rollout_id] = rewait(
                worker,
                (key, payload, since, grading),
                on_status[rollout_id],
                loop=loop,
                grace_sec=grace_sec,
                replied=replied,
                expire=expire,
            )
    return finished, running


def rewait(
    worker: PoolWorker,
    described: tuple[int, tuple[Any, ...], float, bool],
    on_status: Callable[[RolloutStatus], None],
    *,
    loop: asyncio.AbstractEventLoop,
    grace_sec: float,
    replied: Replied,
    expire: Callable[[Dispatch], None],
) -> Dispatch:
    """A dispatch for a rollout ``worker`` runs already, as it ``described`` it (its key,
    request payload, seconds since it received it, whether it grades), waiting on its
    ``wait`` call, with what is left of its deadline plus ``grace_sec``."""
    key, payload, since, grading = described
    now = time.monotonic()
    request, _process_id = decode_request(
        payload, lambda elapsed: now - since - max(0.0, elapsed), on_status, NO_OBSERVER
    )
    grader_timeout = request.grader_timeout_sec
    dispatch = Dispatch(
        key,
        request,
        worker,
        loop.create_future(),
        None if grader_timeout is None else max(0.0, grader_timeout) + grace_sec,
    )
    worker.held += 1
    worker.inflight[key] = dispatch
    when_done(
        loop, worker.handle.wait.remote(key, request.id), functools.partial(replied, dispatch)
    )
    if grading:
        dispatch.grading = True
        on_status(RolloutStatus.GRADING)
        if dispatch.grader_budget_sec is not None:
            dispatch.timer = loop.call_later(dispatch.grader_budget_sec, expire, dispatch)
    elif request.agent_timeout_sec is not None:
        left = request.admitted_at + request.agent_timeout_sec - now
        dispatch.timer = loop.call_later(max(0.0, left) + grace_sec, expire, dispatch)
    return dispatch
