"""train.py with the two processes of a run held apart, for test_multiprocess: the
skew that a slow process 0 (it writes the logs) leaves on GPUs, where dispatch runs
far ahead of the device, made certain on CPU.

    python tests/skewed_train.py <train.py's arguments>

On CPU a call of a program with cross-process collectives returns only once the
previous one has run, so no process gets more than a step ahead of another. Here
each process queues its steps on a thread of their own, as a GPU's stream does, and
the loop waits for them only where it reads their results (Trainer.flush): the host
runs ahead as it does on a GPU.

The environment says where to hold: SKEW_DIR (a directory for the markers below),
SKEW_AT (a step due for reading metrics, log.every divides it), SKEW_AHEAD
(log.every) and SKEW_SIGNALLED (the process the test sends SIGTERM to). Process 0
holds its read of step SKEW_AT's metrics (which runs once step SKEW_AT + 1 is
dispatched) until process 1 has dispatched and checked step SKEW_AT + SKEW_AHEAD,
as far as it gets without process 0. The signalled process then writes
``<id>.ready`` to SKEW_DIR and waits until the test's SIGTERM has reached it:
process 0 in that held read, process 1 just before its stop check of step
SKEW_AT + SKEW_AHEAD. Each process writes the step it stops after to ``<id>.stopped``.
"""

from __future__ import annotations

import os
import runpy
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax

from ndjax.training import hooks, loop, stop_signals

DIR = os.environ["SKEW_DIR"]
AT, AHEAD = int(os.environ["SKEW_AT"]), int(os.environ["SKEW_AHEAD"])
SIGNALLED = int(os.environ["SKEW_SIGNALLED"])
signalled = threading.Event()


class Queued:
    """A step's output not yet computed: its new state, or one of its metrics."""

    def __init__(self, future: Future, metric: str | None = None):
        self.future, self.metric = future, metric

    def get(self) -> Any:
        state, metrics = self.future.result()
        return state if self.metric is None else metrics[self.metric]


def computed(value: Any) -> Any:
    return value.get() if isinstance(value, Queued) else value


class QueuedSteps:
    """The train step as a GPU runs it: a call queues it and returns at once."""

    def __init__(self, step_fn: Callable[..., Any]):
        self.step_fn, self.names = step_fn, None
        self.device = ThreadPoolExecutor(1, thread_name_prefix="device")

    def __call__(self, state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
        future = self.device.submit(lambda: self.step_fn(computed(state), batch))
        if self.names is None:  # the first step: its metrics' names
            self.names = list(future.result()[1])
        return Queued(future), {name: Queued(future, name) for name in self.names}


def wait_for(done: Callable[[], bool]) -> None:
    while not done():
        time.sleep(0.05)


def touch(name: str, text: str = "") -> None:
    with open(os.path.join(DIR, name), "w") as f:
        f.write(text)


def ready_for_the_signal() -> None:
    if jax.process_index() == SIGNALLED:
        touch(f"{SIGNALLED}.ready")
        wait_for(signalled.is_set)


handle = stop_signals.StopSignals._handle


def handle_and_tell(self: stop_signals.StopSignals, signum: int, frame: object) -> None:
    handle(self, signum, frame)
    signalled.set()


fit = loop.Trainer.fit


def queued_fit(self: loop.Trainer, step_fn: Any) -> list[dict[str, Any]]:
    return fit(self, QueuedSteps(step_fn))


host_values_of = hooks.host_values_of


def computed_values_of(steps: Any) -> list[dict[str, Any]]:
    return host_values_of([{k: computed(v) for k, v in step.items()} for step in steps])


flush = loop.Trainer.flush


def held_flush(self: loop.Trainer) -> None:
    if jax.process_index() == 0 and self._pending and self._pending[-1][0] == AT:
        wait_for(lambda: os.path.exists(os.path.join(DIR, "ahead")))
        ready_for_the_signal()
    flush(self)


check = hooks.StopOnSignal.after_step


def marked_check(self: hooks.StopOnSignal, trainer: Any, step: int, outputs: Any) -> None:
    last = jax.process_index() == 1 and step == AT + AHEAD
    if last:
        ready_for_the_signal()
    check(self, trainer, step, outputs)
    if last:
        touch("ahead")
    if trainer.stop_reason:
        touch(f"{jax.process_index()}.stopped", str(step))


save = hooks.Checkpoint.after_step


def computed_save(self: hooks.Checkpoint, trainer: Any, step: int, outputs: Any) -> None:
    if trainer.stop_reason or step == self.last_step or hooks.due(self.every, step):
        trainer.state = computed(trainer.state)  # what it saves (nothing else reads it here)
    save(self, trainer, step, outputs)


stop_signals.StopSignals._handle = handle_and_tell  # type: ignore[method-assign]
loop.Trainer.fit = queued_fit  # type: ignore[method-assign]
hooks.host_values_of = computed_values_of
loop.Trainer.flush = held_flush  # type: ignore[method-assign]
hooks.StopOnSignal.after_step = marked_check  # type: ignore[method-assign]
hooks.Checkpoint.after_step = computed_save  # type: ignore[method-assign]

if __name__ == "__main__":
    train_py = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "train.py")
    sys.argv = [train_py, *sys.argv[1:]]
    runpy.run_path(train_py, run_name="__main__")
