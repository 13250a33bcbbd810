"""Compile time of the train step vs model depth, scanned vs unrolled layers.

Measures, for each depth and for ``model.scan_layers`` True and False, the wall time of
``Experiment.lower_step()`` (tracing + lowering) and of ``.compile()`` (XLA) on a tiny
Llama over 8 simulated CPU devices. Every measurement runs in a fresh subprocess (no
compile caching between runs); each is repeated and the median reported. The claim
checked: compile time of 16 scanned layers stays within 1.5x that of 2.

Run from the repo root:

    PYTHONPATH=. python bench/compile_time.py --layers 2 4 8 16 --repeats 3 \\
        --mesh fsdp=4,tensor=2
    PYTHONPATH=. python bench/compile_time.py --tiny   # smoke run: 2 layers, 1 repeat
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from ndjax.runtime.children import stop_children_on_signals

N_DEVICES = 8
LIMIT = 1.5


def one(layers: int, scan: bool, mesh: dict[str, int]) -> dict[str, float]:
    """Build, lower and compile one configuration in this process; return timings."""
    import jax

    jax.config.update("jax_num_cpu_devices", N_DEVICES)
    from ndjax.config import default_config
    from ndjax.experiment import Experiment

    c = default_config()
    c.model.update(dict(vocab_size=256, dim=64, n_layers=layers, n_heads=8, n_kv_heads=4,
                        ffn_dim=128, scan_layers=scan))
    c.mesh.update(dict(replica=1, fsdp=-1, context=1, tensor=1) | mesh)
    c.train.update(dict(batch_size=8, seq_len=32))
    c.data.source = "synthetic"  # vocab 256: the byte tokenizer needs 259
    exp = Experiment.from_config(c)
    t0 = time.perf_counter()
    lowered = exp.lower_step()
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    return {"lower": t1 - t0, "compile": t2 - t1}


def run_child(layers: int, scan: bool, mesh_arg: str) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--one", str(layers), str(int(scan)), "--mesh", mesh_arg]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:  # the child's traceback, not only its exit status
        sys.stderr.write(out.stderr[-3000:])
        out.check_returncode()
    return json.loads(out.stdout.strip().splitlines()[-1])


def parse_mesh(s: str) -> dict[str, int]:
    return {k: int(v) for k, v in (kv.split("=") for kv in s.split(",") if kv)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mesh", default="fsdp=4,tensor=2", help="e.g. fsdp=4,tensor=2")
    p.add_argument("--tiny", action="store_true",
                   help="smoke run: 2 layers only, 1 repeat (2 fresh processes, seconds)")
    p.add_argument("--one", nargs=2, type=int, metavar=("LAYERS", "SCAN"),
                   help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(a.one[0], bool(a.one[1]), parse_mesh(a.mesh))))
        return

    stop_children_on_signals()  # a stopped sweep stops the run it waits on
    if a.tiny:
        # Both forms (scanned and unrolled) at the sweep's smallest depth: every code
        # path once; the ratio is 1 by construction, the timings mean little.
        a.layers, a.repeats = [2], 1
    configs = [(n, s) for s in (True, False) for n in a.layers]
    runs: dict[tuple[int, bool], list[dict[str, float]]] = {k: [] for k in configs}
    for r in range(a.repeats):  # repeats outermost so machine drift spreads over all configs
        for n, s in configs:
            runs[n, s].append(run_child(n, s, a.mesh))
            t = runs[n, s][-1]
            print(f"# rep {r} layers={n} scan={s}: lower {t['lower']:.2f}s "
                  f"compile {t['compile']:.2f}s", file=sys.stderr, flush=True)

    med = {k: {m: statistics.median(t[m] for t in v) for m in ("lower", "compile")}
           for k, v in runs.items()}
    base = min(a.layers)
    print(f"median of {a.repeats} fresh-process runs; mesh {a.mesh}; "
          f"ratio = compile / compile at {base} layers (same form)\n")
    print("| layers | scan | lower s | compile s | ratio |")
    print("|-------:|:-----|--------:|----------:|------:|")
    for n, s in configs:
        m = med[n, s]
        ratio = m["compile"] / med[base, s]["compile"]
        print(f"| {n} | {s} | {m['lower']:.2f} | {m['compile']:.2f} | {ratio:.2f}x |")
    top = max(a.layers)
    ratio = med[top, True]["compile"] / med[base, True]["compile"]
    ok = "within" if ratio <= LIMIT else "NOT within"
    print(f"\nscanned {top} vs {base} layers: compile ratio {ratio:.2f}x ({ok} {LIMIT}x)")


if __name__ == "__main__":
    main()
