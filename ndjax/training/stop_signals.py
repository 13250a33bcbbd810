"""SIGTERM and Ctrl-C (SIGINT) stop a run after the current step, with a save.

SIGTERM is how SLURM, Kubernetes and spot VMs preempt a job; Ctrl-C is a person at
a terminal. The first of either asks the loop to stop after the current step (the
checkpoint hook then saves it); a second exits at once, without a traceback (the
last complete checkpoint is intact: orbax renames a save into place only when it
is whole).

With several processes, the signal reaches each at a different moment (or only one
of them), and a process that stops to save while the others step on deadlocks them
all. So the first process to get it posts a stop step, and the signal's name, to the
coordinator's key-value store, and every process checks for it each step. The stop
step is 2 after the poster's: when a process checks at step i it has finished step
i-1, which every process joined, so no process is more than one step ahead of
another, and all see the post by then. (A device collective would do too, but on
CPU it could run concurrently with the train step's collectives and pair them up
wrongly.)
"""

from __future__ import annotations

import os
import signal
import sys

import jax

from ndjax.parallel import distributed

# The reason a run stopped, as the messages name it.
NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C"}
CTRL_C = NAMES[signal.SIGINT]


class StopSignals:
    KEY = "ndjax/stop_at_step"

    def __init__(self):
        self.requested = ""  # the first signal's name, "" while none came
        self._previous: dict[int, object] = {}
        for signum in NAMES:
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                break
        self._posted = False
        self._stop: tuple[int, str] | None = None  # (step, reason) posted by anyone

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested:
            # The second: at once. Exit as a shell reports a death by that signal.
            print(f"{NAMES[signum]} again: stopped at once; the checkpoints are intact up "
                  "to the last complete one.", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.requested = NAMES[signum]
        if signum == signal.SIGINT:  # a person waits: say that it was heard
            print("Ctrl-C: saving after the current step, then exiting (Ctrl-C again "
                  "stops at once).", file=sys.stderr, flush=True)

    def should_stop(self, step: int) -> str:
        """The reason to stop after ``step`` ("" for none). Call once per step, on
        every process, after the step's metrics are read."""
        if jax.process_count() == 1:
            return self.requested
        client = distributed.client()
        if self.requested and not self._posted:
            self._posted = True
            try:  # fails if someone posted first: theirs stands
                client.key_value_set(self.KEY, f"{step + 2} {self.requested}")
            except Exception:  # noqa: BLE001
                pass
        if self._stop is None:
            try:
                posted = client.key_value_try_get(self.KEY)
            except Exception:  # noqa: BLE001 -- not posted (NOT_FOUND)
                return ""
            at, reason = posted.split(" ", 1)
            self._stop = int(at), reason
        return self._stop[1] if step >= self._stop[0] else ""

    def close(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


class Interrupted(KeyboardInterrupt):
    """What ``loop.train`` raises after a Ctrl-C stopped the run and its checkpoint
    was saved: a Ctrl-C still interrupts whoever called it (as Python's own does), and
    train.py exits 130 without a traceback."""
