"""SIGTERM and Ctrl-C (SIGINT) stop a run after the current step, with a save.

SIGTERM is how SLURM, Kubernetes and spot VMs preempt a job; Ctrl-C is a person at
a terminal. The first of either asks the loop to stop after the current step (the
checkpoint hook then saves it); a second exits at once, without a traceback (the
last complete checkpoint is intact: orbax renames a save into place only when it
is whole).

With several processes, the signal reaches each at a different moment (or only one
of them), and a process that stops to save while the others step on deadlocks them
all: every process must stop after the same step, one that none of them has gone
past. How far apart the processes are is bounded by nothing the stop can rely on:
with metrics read every log.every steps a process waits for its peers only there,
and dispatch runs ahead of the device (far ahead on GPUs), so one process can be
several steps past another, process 0 (it writes the logs) usually behind. So the
step is agreed from where the processes are, through the coordinator's key-value
store, by every process at every step, after the step is dispatched and before the
next one is:

1. a process publishes the step it has dispatched (``dispatched/<process>``);
2. a process with a signal posts a stop request (``request``; the first one stands);
3. a process reads the request: if there is none, it dispatches its next step.

The process whose request stands then reads every published step and posts the
agreed step, the highest of them + 1 (``at``); a process that reads a request waits
for that, which depends on no device work, only on the poster's next two calls to
the store. Safe by construction, whatever runs between steps (log.every,
train.grad_accum, data prefetch, an evaluation, a save): a process that read no
request at step i had published i before that read, the read came before the
request was posted, and that before the poster read the published steps; so the
agreed step is past i. A process thus dispatches step i + 1 only when the agreed
step is at least i + 1 (it read no request at i, or it knows the agreed step), and
when it first reads the request it has not gone past the agreed step (all start at
the same step, and the poster's is at least that): each stops there. (A device
collective would need a program of its own, which on CPU could run concurrently
with the train step's collectives and pair them up wrongly.)
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
    PREFIX = "ndjax/stop/"  # the keys in the coordinator's store, as the module says
    TIMEOUT_MS = 5 * 60 * 1000  # for the agreed step: only the poster's own two calls

    def __init__(self):
        self.requested = ""  # the first signal's name, "" while none came
        self._previous: dict[int, object] = {}
        for signum in NAMES:
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                break
        self._posted = False
        self._stop: tuple[int, str] | None = None  # (agreed step, reason)

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
        every process, after ``step`` is dispatched and before the next one is."""
        if jax.process_count() == 1:
            return self.requested
        if self._stop is None:
            self._stop = self._agree(step)
        if self._stop is None:
            return ""
        at, reason = self._stop
        return reason if step >= at else ""

    def _agree(self, step: int) -> tuple[int, str] | None:
        """The module's three calls at ``step``; (agreed step, reason) once a request
        is read. The order of the calls is what makes the agreed step safe."""
        client = distributed.client()
        client.key_value_set(f"{self.PREFIX}dispatched/{jax.process_index()}", str(step),
                             allow_overwrite=True)
        if self.requested and not self._posted:
            self._posted = True
            try:  # fails if someone posted first: theirs stands, and they post the step
                client.key_value_set(f"{self.PREFIX}request", self.requested)
            except Exception:  # noqa: BLE001 -- ALREADY_EXISTS
                pass
            else:
                dispatched = client.key_value_dir_get(f"{self.PREFIX}dispatched/")
                at = max(int(value) for _, value in dispatched) + 1
                client.key_value_set(f"{self.PREFIX}at", f"{at} {self.requested}")
        try:
            client.key_value_try_get(f"{self.PREFIX}request")
        except Exception:  # noqa: BLE001 -- NOT_FOUND: no request yet
            return None
        at, reason = client.blocking_key_value_get(f"{self.PREFIX}at",
                                                   self.TIMEOUT_MS).split(" ", 1)
        return int(at), reason

    def close(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


class Interrupted(KeyboardInterrupt):
    """What ``loop.train`` raises after a Ctrl-C stopped the run and its checkpoint
    was saved: a Ctrl-C still interrupts whoever called it (as Python's own does), and
    train.py exits 130 without a traceback."""
