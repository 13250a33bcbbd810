"""Time to the first step of ``train.py``, and where it goes.

Each run is a fresh process that runs ``train.py`` itself (its flags, its set-up);
this script only listens: jax's monitoring events give every top-level trace,
lowering and XLA compile with the function's name, and a hook added to the run
marks when step 1's batch was ready and when step 1 had finished. A round is a
cold run (an empty persistent compilation cache) then a warm one (the cache the
cold run wrote), so the two alternate; the table gives each phase's median.

Run from the repo root:

    PYTHONPATH=. python bench/first_step.py --rounds 3 [--mesh 1 1 1] [--config.x=y ...]
    PYTHONPATH=. python bench/first_step.py --steps 30 --mesh 2 2 2 --stability
    PYTHONPATH=. python bench/first_step.py --tiny   # smoke run: a 2-layer dim-64 model

The job (issue 33): Llama, vocab 4096, dim 256, 4 layers, float32, batch 8 x 256,
synthetic data; ``--mesh R F T`` sets replica x fsdp x tensor (and that many
simulated CPU devices). ``--stability`` also prints each run's step times after
the first (from metrics.jsonl, log.every=1).
"""

from __future__ import annotations

import time

_SPAWNED = time.time()  # as early as the child can know it: the interpreter's start is before

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections import defaultdict  # noqa: E402
from typing import Any  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = ["--config.model.vocab_size=4096", "--config.model.dim=256", "--config.model.n_layers=4",
       "--config.model.dtype=float32", "--config.train.batch_size=8",
       "--config.train.seq_len=256", "--config.data.source=synthetic"]
TINY = ["--config.model.vocab_size=256", "--config.model.dim=64", "--config.model.n_layers=2",
        "--config.model.n_heads=8", "--config.model.n_kv_heads=4", "--config.model.ffn_dim=128",
        "--config.train.batch_size=8", "--config.train.seq_len=32",
        "--config.data.source=synthetic"]
EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "compile"}
PHASES = ("trace", "lower", "compile")


# ----- the child: train.py with listeners ----------------------------------------------

def child(out_path: str, argv: list[str]) -> None:
    """Runs train.py's main with ``argv``; writes the timeline to ``out_path``."""
    started = float(os.environ["FIRST_STEP_SPAWNED"])
    import runpy

    import jax
    from jax import monitoring

    import ndjax.training.loop
    from ndjax.training.hooks import Hook
    imported = time.time()
    spans: list[tuple[str, str, float, float]] = []
    counts: dict[str, int] = defaultdict(int)

    def on_span(event: str, start: float, end: float, **kw: Any) -> None:
        if event in EVENTS:
            spans.append((EVENTS[event], str(kw.get("fun_name", "?")), start, end))

    def on_event(event: str, **kw: Any) -> None:
        counts[event.rsplit("/", 1)[-1]] += 1

    monitoring.register_event_time_span_listener(on_span)
    monitoring.register_event_listener(on_event)
    marks: dict[str, float] = {}
    reads: list[tuple[int, float, float]] = []

    class Marks(Hook):
        def start(self, trainer: Any) -> None:
            marks["fit"] = time.time()

        def before_step(self, trainer: Any, step: int) -> None:
            if step == trainer.first_step:
                marks["batch"] = time.time()

        def after_step(self, trainer: Any, step: int, outputs: Any) -> None:
            if step == trainer.first_step:
                jax.block_until_ready(outputs)  # step 1 done, not only dispatched
                marks["step"] = time.time()

        def on_metrics(self, trainer: Any, step: int, values: dict[str, Any]) -> None:
            # Wall and this process's CPU seconds at each read: where the wall time
            # grows and the CPU time does not, something else had the cores.
            cpu = os.times()
            reads.append((step, time.time(), cpu.user + cpu.system))

    train = ndjax.training.loop.train

    def marked(*args: Any, **kw: Any) -> Any:
        marks["train"] = time.time()
        return train(*args, **kw, extra_hooks=[Marks()])

    ndjax.training.loop.train = marked  # train.py imports it from here when main runs
    sys.argv = [os.path.join(ROOT, "train.py"), *argv]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code:
            raise
    with open(out_path, "w") as f:
        json.dump({"spawned": started, "child": _SPAWNED, "imported": imported, **marks,
                   "spans": spans, "counts": counts, "reads": reads}, f)


# ----- the parent: runs, rounds, the table ---------------------------------------------

def _has_cache_setting() -> bool:
    """Whether this checkout has runtime.compilation_cache (so its runs before it can
    be measured with the same script)."""
    import dataclasses

    from ndjax.config import RuntimeSettings
    return any(f.name == "compilation_cache" for f in dataclasses.fields(RuntimeSettings))


def run_once(argv: list[str], cache: str | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as workdir:
        out = os.path.join(workdir, "timeline.json")
        env = dict(os.environ, FIRST_STEP_SPAWNED=repr(time.time()))
        # Both ways, the environment and the setting, so that this script measures
        # code from before the setting too.
        if cache is None:
            env.pop("JAX_COMPILATION_CACHE_DIR", None)
        else:
            env["JAX_COMPILATION_CACHE_DIR"] = cache
        if _has_cache_setting():
            argv = [*argv, f"--config.runtime.compilation_cache={cache or 'off'}"]
        cmd = [sys.executable, os.path.abspath(__file__), "--child", out, "--",
               f"--workdir={workdir}", *argv]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode:
            sys.stderr.write(proc.stderr[-4000:])
            proc.check_returncode()
        with open(out) as f:
            timeline = json.load(f)
        metrics = os.path.join(workdir, "metrics.jsonl")
        with open(metrics) as f:
            timeline["step_times"] = [r["step_time"] for r in map(json.loads, f)
                                      if "step_time" in r]
        return timeline


def _merged(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of the intervals (nested events counted once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def split(t: dict[str, Any]) -> dict[str, float]:
    """One run's seconds per phase, up to step 1's end."""
    before = [s for s in t["spans"] if s[3] <= t["step"]]
    jax_time = {p: _merged([(a, b) for k, _, a, b in before if k == p]) for p in PHASES}
    in_setup = [(a, b) for _, _, a, b in before if a >= t["train"] and b <= t["batch"]]
    in_step = [(a, b) for _, _, a, b in before if a >= t["batch"]]
    row = {"start + imports": t["imported"] - t["spawned"],
           "flags + distributed": t["train"] - t["imported"],
           **jax_time,
           "set-up (not jax)": t["batch"] - t["train"] - _merged(in_setup),
           "step 1 (not compiles)": t["step"] - t["batch"] - _merged(in_step),
           "first step (total)": t["step"] - t["spawned"]}
    # Anything compiled before train() started (flag parsing, distributed) is in
    # the trace/lower/compile rows and out of "flags + distributed".
    row["flags + distributed"] -= _merged([(a, b) for _, _, a, b in before if b <= t["train"]])
    return row


def per_function(t: dict[str, Any]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(PHASES, 0.0))
    for kind, name, a, b in t["spans"]:
        if b <= t["step"]:
            out[name][kind] += b - a
    return out


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(runs: dict[str, list[dict[str, Any]]], stability: bool) -> None:
    modes = [m for m in ("cold", "warm") if runs.get(m)]
    splits = {m: [split(t) for t in runs[m]] for m in modes}
    print("| phase | " + " | ".join(f"{m} s (median of {len(runs[m])})" for m in modes) + " |")
    print("|:--|" + "--:|" * len(modes))
    for phase in splits[modes[0]][0]:
        cells = [f"{_median([s[phase] for s in splits[m]]):.2f}" for m in modes]
        print(f"| {phase} | " + " | ".join(cells) + " |")
    for m in modes:
        counts = runs[m][-1]["counts"]
        print(f"{m}: cache hits {counts.get('cache_hits', 0)}, misses "
              f"{counts.get('cache_misses', 0)} (last run)")
    for m in modes:
        print(f"\n{m}: seconds per compiled function before step 1 end (last run)")
        print("| function | trace | lower | compile |")
        print("|:--|--:|--:|--:|")
        fns = per_function(runs[m][-1])
        for name, v in sorted(fns.items(), key=lambda kv: -sum(kv[1].values())):
            print(f"| {name} | {v['trace']:.2f} | {v['lower']:.2f} | {v['compile']:.2f} |")
    if stability:
        print("\nstep times after step 1 (s), each run:")
        for m in modes:
            for t in runs[m]:
                times = t["step_times"][1:]
                print(f"{m}: median {_median(times):.3f} min {min(times):.3f} "
                      f"max {max(times):.3f}: " + " ".join(f"{x:.2f}" for x in times))
                r = t["reads"][1:]
                cores = [(c1 - c0) / (w1 - w0) for (_, w0, c0), (_, w1, c1) in zip(r, r[1:])]
                print(f"{m}: cores busy for this process between reads: "
                      + " ".join(f"{x:.2f}" for x in cores))


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        return child(sys.argv[2], sys.argv[4:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--mesh", type=int, nargs=3, default=[1, 1, 1], metavar=("R", "F", "T"))
    p.add_argument("--no-warm", action="store_true", help="cold runs only")
    p.add_argument("--no-cache", action="store_true",
                   help="the cold runs with the persistent cache off (nothing written)")
    p.add_argument("--stability", action="store_true", help="print step times after step 1")
    p.add_argument("--tiny", action="store_true", help="smoke run: a 2-layer dim-64 model")
    a, extra = p.parse_known_args()
    from ndjax.runtime.children import stop_children_on_signals
    stop_children_on_signals()  # a stopped run stops the run it waits on
    r, f, t = a.mesh
    argv = [*(TINY if a.tiny else JOB), f"--config.mesh.replica={r}",
            f"--config.mesh.fsdp={f}", "--config.mesh.context=1", f"--config.mesh.tensor={t}",
            f"--config.runtime.cpu_devices={r * f * t}", f"--config.train.steps={a.steps}",
            "--config.log.every=1", "--config.checkpoint.async_save=False", *extra]
    rounds = 1 if a.tiny else a.rounds
    print(f"# first step: {' '.join(argv)}; {rounds} round(s)", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
    for _ in range(rounds):
        with tempfile.TemporaryDirectory(prefix="first-step-xla-") as cache:
            runs["cold"].append(run_once(argv, None if a.no_cache else cache))
            if not (a.no_warm or a.no_cache):
                runs["warm"].append(run_once(argv, cache))
    report(runs, a.stability)


if __name__ == "__main__":
    main()
