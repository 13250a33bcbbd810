"""What ndjax.runs.checkpoint does when the disk fails it: a checkpoint that no longer
reads (a file cut short by a host crash or a bad disk) and a save that cannot be
written (disk full, quota, file-size limit, I/O error).

An unreadable checkpoint is moved aside, never deleted, to a name that orbax counts
neither as a step (those are bare step numbers) nor as an interrupted save to clean
up (those contain ``.orbax-checkpoint-tmp``): ``<step>.unreadable``. With several
processes, every one reads the same step and they agree on the outcome through the
coordinator's key-value store before any of them moves on, so they never restore
different steps. The checkpoints after an explicit ``checkpoint.resume=<step>`` are
moved aside the same way, to ``<step>.superseded``.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import Any

import jax

from ndjax.parallel import distributed

QUARANTINE_SUFFIX = ".unreadable"
# Checkpoints newer than an explicit checkpoint.resume=<step>, moved aside until the
# resumed run has saved one of its own (ndjax.runs.checkpoint.Checkpointer.supersede_newer_than).
SUPERSEDED_SUFFIX = ".superseded"
_AGREE_TIMEOUT_MS = 10 * 60 * 1000  # reading a large checkpoint takes a while


class SaveError(RuntimeError):
    """A checkpoint could not be written; the message is one line naming the step,
    the directory and the OS error. The checkpoints before it are intact."""


def first_line(e: BaseException, limit: int = 300) -> str:
    """The first line of the error at the root of ``e`` (orbax wraps tensorstore's
    "OUT_OF_RANGE: Error reading ..." in errors that say less)."""
    while (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    text = (str(e).strip().splitlines() or [""])[0]
    return (text or type(e).__name__)[:limit]


def os_error(e: BaseException) -> str:
    """The OS error under ``e``: Python's OSError, or tensorstore's
    ``[os_error_code='27']`` inside a ValueError; else the first line of ``e``."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return f"{seen.strerror} (errno {seen.errno})"
        code = re.search(r"os_error_code='(\d+)'", str(seen))
        if code:
            return f"{os.strerror(int(code.group(1)))} (errno {code.group(1)})"
        seen = seen.__cause__ or seen.__context__
    return first_line(e)


def all_read(step: int, error: str | None) -> list[tuple[int, str]]:
    """Every process's read of ``step``, as (process, error) for those that failed;
    with several processes a failure on any one is a failure for all."""
    if jax.process_count() == 1:
        return [] if error is None else [(0, error)]
    kv = distributed.client()
    me, n = jax.process_index(), jax.process_count()
    # "" = read fine; keys are per step, and each step is tried at most once a run.
    kv.key_value_set(f"ndjax/restore/{step}/{me}", error or "")
    answers = [kv.blocking_key_value_get(f"ndjax/restore/{step}/{i}", _AGREE_TIMEOUT_MS)
               for i in range(n)]
    return [(i, a) for i, a in enumerate(answers) if a]


def move_aside(directory: str, step: int, suffix: str = QUARANTINE_SUFFIX) -> str:
    """Renames ``directory/<step>`` to ``<step><suffix>`` (``<suffix>.1``, ... when a
    run already moved that step aside once) on process 0, after every process has
    read it; the others wait for the rename. Returns the new path."""
    source = os.path.join(directory, str(step))
    target, n = source + suffix, 0
    while os.path.exists(target):
        n += 1
        target = f"{source}{suffix}.{n}"
    if jax.process_index() == 0:
        os.rename(source, target)
    if jax.process_count() > 1:
        kv = distributed.client()
        key = f"ndjax/restore/{step}/moved{suffix}"
        if jax.process_index() == 0:
            kv.key_value_set(key, target)
        target = kv.blocking_key_value_get(key, _AGREE_TIMEOUT_MS)
    return target


def _from_orbax(e: BaseException) -> bool:
    """An error of orbax's reading or writing: raised in its code, or a tensorstore
    write into a save's temporary directory."""
    if ".orbax-checkpoint-tmp" in str(e):
        return True
    orbax, tb = f"{os.sep}orbax{os.sep}", e.__traceback__
    while tb is not None:
        if orbax in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


class _ReraisedElsewhere(logging.Filter):
    """Drops ERROR records of orbax's errors: a background save's failure, which orbax
    logs from every thread it passes through (hundreds of traceback lines), and
    asyncio's "exception was never retrieved" for the writes that failed beside the
    first."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not record.exc_info:
            return True
        error = record.exc_info[1]
        return not ((error is not None and _from_orbax(error))
                    or f"{os.sep}orbax{os.sep}" in record.pathname)


def _is_late_tensorstore_callback(value: BaseException) -> bool:
    tb = value.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return (isinstance(value, RuntimeError) and str(value) == "Event loop is closed"
            and tb is not None and "asyncio" in tb.tb_frame.f_code.co_filename)


def quiet_failed_saves() -> None:
    """Keeps a failed save to the one line ndjax.runs.checkpoint reports.

    Orbax re-raises a background save's error in the main thread (at the next save or
    wait), where Checkpointer turns it into a SaveError; meanwhile it logs it with a
    traceback from every thread it passes through. And when one write fails, orbax
    closes the event loop the save ran on while tensorstore still completes the other
    writes: each of their callbacks fails on the closed loop, and tensorstore prints
    that with PyErr_WriteUnraisable (so through sys.unraisablehook), about a hundred
    tracebacks that say nothing but "Event loop is closed"; the reads and writes
    abandoned beside the one that failed are reported again as "Exception ignored"
    when they are garbage-collected. All are dropped: ndjax.runs.checkpoint reports the
    failure once. Anything else passes.
    """
    for name in ("absl", "asyncio"):  # orbax logs through absl; asyncio on its own
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ReraisedElsewhere) for f in logger.filters):
            logger.addFilter(_ReraisedElsewhere())
    previous = sys.unraisablehook
    if getattr(previous, "ndjax_quiet", False):
        return

    def hook(unraisable: Any) -> None:
        value = unraisable.exc_value
        if value is None or not (_is_late_tensorstore_callback(value) or _from_orbax(value)):
            previous(unraisable)

    hook.ndjax_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
