"""One trainer per workdir: ``<workdir>/.lock``, held by process 0 of a run.

Two trainers on one workdir (a job resubmitted while the first still runs) would
delete each other's in-flight checkpoints and interleave metrics lines. The lock is
an ``fcntl.flock`` on ``.lock``, which the kernel releases when its holder dies,
however it dies; the file also names the holder (host, pid, since when), because
flock may not reach across hosts on a network filesystem: a lock written on another
host is refused, not taken over, since this host cannot tell whether that run lives.

Released, the file is emptied, not deleted: deleting it would let a process that
opened the old file lock a path no one else sees. An empty ``.lock`` is free; one
that names a holder no one locks is a dead run's, taken over with a warning.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
import warnings
from collections.abc import Callable

import jax

from ndjax.parallel import distributed
from ndjax.runtime.errors import ConfigError

NAME = ".lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def _holder(text: str) -> dict | None:
    try:
        holder = json.loads(text)
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


def _who(holder: dict) -> str:
    return (f"pid {holder.get('pid')} on host {holder.get('host')!r}, "
            f"since {holder.get('since')}")


class WorkdirLock:
    """Holds ``<workdir>/.lock`` from ``acquire`` until ``release``."""

    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, NAME)
        self._fd: int | None = None

    def acquire(self) -> None:
        """ConfigError (one line naming the holder and the fix) when another run holds
        the workdir; an OSError when the workdir cannot be written (the caller says so)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            locked = self._flock(fd)
            holder = _holder(os.pread(fd, 4096, 0).decode(errors="replace"))
            self._check(holder, locked)
            me = dict(host=socket.gethostname(), pid=os.getpid(),
                      since=time.strftime("%Y-%m-%d %H:%M:%S %z"), command=sys.argv)
            data = (json.dumps(me) + "\n").encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def _flock(self, fd: int) -> bool | None:
        """True: this process now holds the flock; False: another process does; None:
        this filesystem has no flock, so the holder's pid decides (same host only)."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        except OSError as e:
            if e.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                return None
            raise

    def _check(self, holder: dict | None, locked: bool | None) -> None:
        fix = "wait for it to finish, stop it, or use another --workdir"
        if locked is False:  # a live process holds it, here or (NFS) on another host
            who = _who(holder) if holder else "another process"
            raise ConfigError(f"{self.path}: the workdir is in use by another run ({who}); "
                              f"{fix}.")
        if holder is None:
            return  # free (empty, or never written)
        if holder.get("host") != socket.gethostname():
            raise ConfigError(
                f"{self.path}: the workdir is locked by a run on another host ({_who(holder)}), "
                f"which this host cannot check. If that run is still going, {fix}; if it is "
                f"dead, delete {self.path} and start again.")
        pid = holder.get("pid")
        if locked is None and isinstance(pid, int) and pid != os.getpid() and _alive(pid):
            raise ConfigError(f"{self.path}: the workdir is in use by another run "
                              f"({_who(holder)}); {fix}.")
        # Same host and no one holds the flock: its holder died without releasing it.
        # (stacklevel: the warning names the claim in loop.train.)
        warnings.warn(f"{self.path}: taking over the lock of a run that is gone "
                      f"({_who(holder)}; it ended without releasing it).", stacklevel=5)

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)  # free: the next run takes it without a warning
        os.close(fd)  # closing the last descriptor releases the flock


def claim(workdir: str, timeout_s: float = 3600.0) -> WorkdirLock | None:
    """Creates ``workdir`` and locks it (process 0; the others get None), before anything
    is written there. A workdir that cannot be written, or that another run holds, is
    a ConfigError on every process: process 0 posts its verdict to the coordinator and
    the others wait for it, so no process writes (checkpoint shards) into a workdir
    process 0 refused, and none is left waiting in a collective for a process 0 that
    left. (A process 0 that dies meanwhile is reported by the peer watch.)"""
    multi = jax.process_count() > 1
    key = "ndjax/workdir_claim"
    if jax.process_index() != 0:
        verdict = distributed.client().blocking_key_value_get(key, int(timeout_s * 1000))
        if verdict:
            raise ConfigError(f"(process 0) {verdict}")
        _writable(workdir, os.makedirs, workdir, exist_ok=True)
        return None
    lock = WorkdirLock(workdir)
    try:
        _writable(workdir, os.makedirs, workdir, exist_ok=True)
        _writable(workdir, lock.acquire)
    except ConfigError as e:
        if multi:
            distributed.client().key_value_set(key, str(e))
        raise
    if multi:
        distributed.client().key_value_set(key, "")
    return lock


def _writable(workdir: str, fn: Callable[..., object], *args: object, **kwargs: object) -> None:
    """``fn(*args)``, its OSError (no permission, a file where a folder should be, a
    read-only filesystem) a one-line ConfigError naming the path and the reason."""
    try:
        fn(*args, **kwargs)
    except OSError as e:
        where = e.filename or workdir
        raise ConfigError(f"--workdir={workdir!r}: cannot write {where}: {e.strerror}. "
                          "Use a directory this user can create and write.") from e
