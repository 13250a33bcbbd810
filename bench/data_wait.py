"""How long each train step waits for its data, with and without the loader thread.

Runs ``train.py`` (the default experiment: the ``tiny`` model, FSDP x TP over 8
simulated CPU devices, the builtin stdlib corpus, byte tokenizer) once per
``data.prefetch`` value, each in a fresh process, and reads ``data_wait`` (the
seconds the loop spent getting the step's batch onto the devices) and
``step_time`` from its metrics.jsonl. The first ``--skip`` steps are left out
(the loader thread fills its queue while the step compiles).

Run from the repo root:

    PYTHONPATH=. python bench/data_wait.py --steps 40 --prefetch 2 0 [--config.x=y ...]
    PYTHONPATH=. python bench/data_wait.py --tiny   # smoke run: 2-layer dim-64 model, 4 steps
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from ndjax.runtime.children import stop_children_on_signals

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# --tiny's model: the tests' tiny Llama, with a vocabulary the byte tokenizer fits
# (259 ids; 384 splits over tensor=2), so the data path stays the builtin corpus.
TINY = ["--config.model.vocab_size=384", "--config.model.dim=64", "--config.model.n_layers=2",
        "--config.model.n_heads=8", "--config.model.n_kv_heads=4", "--config.model.ffn_dim=128",
        "--config.log.tensorboard=False"]


def run(prefetch: int, steps: int, extra: list[str],
        env: dict[str, str] | None = None) -> list[dict[str, float]]:
    with tempfile.TemporaryDirectory() as workdir:
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), f"--workdir={workdir}",
               f"--config.train.steps={steps}", f"--config.data.prefetch={prefetch}", *extra]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        if out.returncode != 0:  # train.py's error, not only its exit status
            sys.stderr.write(out.stderr[-3000:])
            out.check_returncode()
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            return [r for r in map(json.loads, f) if "data_wait" in r]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out")
    p.add_argument("--prefetch", type=int, nargs="+", default=[2, 0])
    p.add_argument("--tiny", action="store_true",
                   help="smoke run: a 2-layer dim-64 model, 4 steps (first 2 left out)")
    # Anything else is passed on to train.py, e.g. --config.train.seq_len=256.
    a, extra = p.parse_known_args()
    a.extra = extra
    stop_children_on_signals()  # a stopped run stops the train.py it waits on
    env = None
    if a.tiny:
        # Flags given on the command line come after TINY's, so they still win.
        a.steps, a.skip, a.extra = 4, 2, [*TINY, *extra]
        # Compiling is most of a tiny run (about 17 s of 20 on 2 cores) and both
        # settings compile the same programs: a cache shared by the runs compiles
        # them once. Not in the full run, whose first steps are left out anyway.
        if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
            cache = tempfile.TemporaryDirectory(prefix="ndjax-bench-cache-")
            env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache.name}
    print(f"{a.steps} steps, first {a.skip} left out; flags: {' '.join(a.extra) or '(defaults)'}\n")
    print("| data.prefetch | data_wait median ms | mean ms | p90 ms | max ms "
          "| step_time median ms | wait / step time |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for prefetch in a.prefetch:
        records = run(prefetch, a.steps, a.extra, env)[a.skip:]
        wait = sorted(r["data_wait"] * 1e3 for r in records)
        step = [r["step_time"] * 1e3 for r in records]
        share = sum(wait) / sum(step)
        print(f"| {prefetch} | {statistics.median(wait):.2f} | {statistics.fmean(wait):.2f} | "
              f"{wait[int(0.9 * (len(wait) - 1))]:.2f} | {wait[-1]:.2f} | "
              f"{statistics.median(step):.0f} | {100 * share:.2f}% |", flush=True)


if __name__ == "__main__":
    main()
