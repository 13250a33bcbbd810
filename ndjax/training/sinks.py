"""Where metrics go: metrics.jsonl (always), TensorBoard, the terminal, and the
experiment trackers the log section turns on (W&B, MLflow: ndjax.training.trackers).

Only process 0 writes or prints; other processes get a Sinks that does nothing.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from types import TracebackType
from typing import Any

from ndjax.config import Settings
from ndjax.training import trackers as trackers_lib

PROGRESS_FIELDS = ("loss", "tokens_per_sec")


def _json_value(v: Any) -> Any:
    # NaN/Inf are not JSON: a skipped step's loss is written as null.
    return None if isinstance(v, float) and not math.isfinite(v) else v


def read_records(path: str) -> list[tuple[dict[str, Any], str]]:
    """metrics.jsonl's records and their lines (newline-terminated). A line that is not
    a JSON object with an integer ``step`` (a last line torn by a host crash or a full
    disk, or anything else) is left out with one warning, never an error: nothing
    written for people to read may stop a resume or a plot."""
    out, bad = [], []
    with open(path, errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                out.append((record, line if line.endswith("\n") else line + "\n"))
            else:
                bad.append(n)
    if bad:
        shown = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
        warnings.warn(f"{path}: left out {len(bad)} line(s) that are not metrics records "
                      f"(line {shown}; a write cut short by a crash or a full disk)",
                      stacklevel=2)
    return out


def _preference_part(record: dict[str, Any]) -> str:
    """A preference objective's reward margin and accuracy (TRL's rewards/margins,
    rewards/accuracies) for the step line; "" for other objectives."""
    if "rewards/margins" not in record:
        return ""
    return (f"margin {record['rewards/margins']:.4f}  "
            f"accuracy {100 * record['rewards/accuracies']:.0f}%  ")


def summary_writer_class() -> type:
    """tensorboardX's ``SummaryWriter``, imported without PyTorch where this process has
    not imported it already. tensorboardX's writer imports torch only to accept torch
    tensors as well as numpy arrays (``try: import torch``), and ndjax writes Python
    floats: with torch installed (the test extra, or a user's transformers) that import
    cost ~1.6 s before step 1 (bench/first_step.py). ``sys.modules["torch"] = None``
    makes that one ``import torch`` fail as if torch were absent, and is undone at once,
    so that the rest of the process imports torch as usual."""
    if "torch" in sys.modules or "tensorboardX.writer" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class Sinks:
    """Writes each record everywhere it goes; a context manager whose exit ends the
    trackers' runs as the run ended (success, failed, or killed by Ctrl-C).

    ``settings``: the run's, for its trackers (none without); ``append``: the run
    resumed from a checkpoint of ``workdir``, so the trackers continue their runs."""

    def __init__(self, workdir: str, total_steps: int, *, enabled: bool = True,
                 tensorboard: bool = True, verbose: bool = True, append: bool = False,
                 settings: Settings | None = None):
        self.enabled, self.verbose, self.total_steps = enabled, verbose, total_steps
        self._jsonl = self._tb = self._bar = None
        self._trackers = trackers_lib.Trackers([])
        if not enabled:
            return
        self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a" if append else "w")
        if settings is not None:
            self._trackers = trackers_lib.start(settings, workdir, resumed=append)
        if tensorboard:
            self._tb = summary_writer_class()(logdir=os.path.join(workdir, "tb"))
        if verbose and sys.stdout.isatty():
            from tqdm import tqdm
            self._bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps({k: _json_value(v) for k, v in record.items()}) + "\n")
        self._jsonl.flush()
        self._trackers.log(record)
        step = record["step"]
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and value is not None:
                    self._tb.add_scalar(key, value, step)
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix(loss=f"{record['loss']:.4f}",
                                  tok_s=f"{record['tokens_per_sec']:.0f}",
                                  **({"epoch": f"{record['data/epoch']:.2f}"}
                                     if "data/epoch" in record else {}))
        elif self.verbose:
            mfu = record.get("mfu")
            print(f"step {step}/{self.total_steps}  loss {record['loss']:.4f}  "
                  + (f"aux_loss {record['aux_loss']:.4f}  " if "aux_loss" in record else "")
                  + _preference_part(record)
                  + f"grad_norm {record['grad_norm']:.3f}  lr {record['lr']:.2e}  "
                  f"{record['tokens_per_sec']:.0f} tok/s  "
                  f"{record['tflops_per_device']:.3g} TFLOP/s/device"
                  + (f"  MFU {100 * mfu:.1f}%" if mfu is not None else "")
                  + (f"  epoch {record['data/epoch']:.2f}" if "data/epoch" in record else "")
                  + (f"  fill {100 * record['data/fill']:.0f}%" if "data/fill" in record
                     else ""), flush=True)

    def write_eval(self, record: dict[str, Any]) -> None:
        """An evaluation record: {step, eval_loss, eval_perplexity, eval_tokens}."""
        if not self.enabled:
            return
        self._jsonl.write(json.dumps({k: _json_value(v) for k, v in record.items()}) + "\n")
        self._jsonl.flush()
        self._trackers.log(record)
        if self._tb is not None:
            for key in ("eval_loss", "eval_perplexity"):
                self._tb.add_scalar(key, record[key], record["step"])
        self.message(f"step {record['step']}/{self.total_steps}  eval loss "
                     f"{record['eval_loss']:.4f}  perplexity {record['eval_perplexity']:.2f}")

    def message(self, text: str) -> None:
        if self.enabled and self.verbose:
            (self._bar.write if self._bar is not None else print)(text)

    def __enter__(self) -> Sinks:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        outcome = ("success" if kind is None else
                   "killed" if issubclass(kind, KeyboardInterrupt) else "failed")
        self.close(outcome)

    def close(self, outcome: str = "success") -> None:
        """Closes every sink; the trackers' runs end as ``outcome`` says (success,
        failed or killed)."""
        self._trackers.finish(outcome)
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()
