"""Child processes end with the process that started them.

A stopped process must stop its children: a planner ended by ``timeout`` (SIGTERM)
once left its compile workers running for an hour. Two halves:

* ``stop_children_on_signals()``, in the parent: SIGTERM or SIGINT ends every child
  and grandchild (SIGTERM, then SIGKILL after a grace period), then the parent dies
  of the signal, as it would have without the handler (128 + signal to a shell).
* ``die_with_parent(parent)``, first thing in a child that runs ndjax code (a worker
  pool's initializer): the kernel kills the child when its parent dies, SIGKILL
  included, which no handler in the parent can catch (Linux; elsewhere only the
  signal half applies).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
GRACE_S = 2.0         # how long a child has to exit on SIGTERM before it gets SIGKILL


def _parents() -> dict[int, int]:
    """pid -> parent pid of every live process (zombies excluded: they have ended)."""
    if not os.path.isdir("/proc"):  # not Linux: this process's multiprocessing children
        return {p.pid: os.getpid() for p in multiprocessing.active_children() if p.pid}
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:  # exited while we looked
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
        if state not in ("Z", "X"):
            out[int(name)] = int(ppid)
    return out


def children(pid: int) -> list[int]:
    """The live child processes of ``pid``."""
    return [c for c, p in _parents().items() if p == pid]


def descendants(pid: int) -> list[int]:
    """The live children of ``pid``, theirs, and so on (a bench worker's own workers)."""
    parents = _parents()
    out, frontier = [], [pid]
    while frontier:
        frontier = [c for c, p in parents.items() if p in frontier]
        out += frontier
    return out


def end_children(grace_s: float = GRACE_S) -> None:
    """SIGTERM to every descendant of this process, SIGKILL to those left after
    ``grace_s``. Grandchildren too: a child that dies of SIGTERM leaves its own
    children running, reparented away from it."""
    pids = descendants(os.getpid())
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        pids = [p for p in pids if p in _parents()]
    for pid in pids:
        _signal(pid, signal.SIGKILL)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _die_of(signum: int, frame: object) -> None:
    end_children()
    # Die of the signal itself, so that whoever waits on this process sees it.
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # only if the signal did not end the process


def stop_children_on_signals() -> None:
    """For the rest of this process, SIGTERM and SIGINT end its children, then it.

    Python runs the handler in the main thread between bytecodes, so a main thread
    that waits on its children (a pool's results, ``subprocess.run``) handles it at
    once; one that is inside a long C call (a compile in this process) only after it.
    """
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _die_of)


def die_with_parent(parent: int) -> None:
    """In a child: have the kernel SIGKILL it when ``parent`` (its parent's pid) dies.

    The kernel sends the signal when the thread that started the child exits: a pool
    must be started from the main thread (ProcessPoolExecutor with the spawn method
    starts its workers in the thread that submits)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:  # it died before the prctl: nobody will send the signal
        os._exit(1)
