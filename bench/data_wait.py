"""How long each train step waits for its data, with and without the loader thread.

Runs ``train.py`` (the default experiment: the ``tiny`` model, FSDP x TP over 8
simulated CPU devices, the builtin stdlib corpus, byte tokenizer) once per
``data.prefetch`` value, each in a fresh process, and reads ``data_wait`` (the
seconds the loop spent getting the step's batch onto the devices) and
``step_time`` from its metrics.jsonl. The first ``--skip`` steps are left out
(the loader thread fills its queue while the step compiles).

Run from the repo root:

    PYTHONPATH=. python bench/data_wait.py --steps 40 --prefetch 2 0 [--config.x=y ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(prefetch: int, steps: int, extra: list[str]) -> list[dict[str, float]]:
    with tempfile.TemporaryDirectory() as workdir:
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), f"--workdir={workdir}",
               f"--config.train.steps={steps}", f"--config.data.prefetch={prefetch}", *extra]
        subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True)
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            return [r for r in map(json.loads, f) if "data_wait" in r]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out")
    p.add_argument("--prefetch", type=int, nargs="+", default=[2, 0])
    # Anything else is passed on to train.py, e.g. --config.train.seq_len=256.
    a, extra = p.parse_known_args()
    a.extra = extra
    print(f"{a.steps} steps, first {a.skip} left out; flags: {' '.join(a.extra) or '(defaults)'}\n")
    print("| data.prefetch | data_wait median ms | mean ms | p90 ms | max ms "
          "| step_time median ms | wait / step time |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for prefetch in a.prefetch:
        records = run(prefetch, a.steps, a.extra)[a.skip:]
        wait = sorted(r["data_wait"] * 1e3 for r in records)
        step = [r["step_time"] * 1e3 for r in records]
        share = sum(wait) / sum(step)
        print(f"| {prefetch} | {statistics.median(wait):.2f} | {statistics.fmean(wait):.2f} | "
              f"{wait[int(0.9 * (len(wait) - 1))]:.2f} | {wait[-1]:.2f} | "
              f"{statistics.median(step):.0f} | {100 * share:.2f}% |", flush=True)


if __name__ == "__main__":
    main()
