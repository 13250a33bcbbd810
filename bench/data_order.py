"""What the data order costs: an epoch's order of n documents, and the order of one
batch's token-file windows, with this tree's shuffles (Grain's ``index_shuffle``) beside
another tree's (``--before=DIR``: a checkout from before Grain, whose epoch orders were
numpy permutations and whose window order was a vectorised Feistel ``permute``).

Each tree runs in a fresh process; each figure is the best of ``--repeat`` runs.

    PYTHONPATH=. python bench/data_order.py --before /tmp/ndjax_e5944ef
    PYTHONPATH=. python bench/data_order.py --tiny   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def measure(sizes: list[int], rows: int, repeat: int) -> dict:
    """Seconds per epoch order (by n) and per batch of ``rows`` window indices, with the
    ndjax on ``sys.path``."""
    from ndjax.data import streams

    if hasattr(streams, "shuffled"):  # Grain's
        def epoch(n):
            return streams.shuffled(np.arange(n), n, 1234, 0)

        def windows(index, n):
            return streams.shuffled(index, n, 1234, 0)
    else:  # before Grain: numpy's permutation and the Feistel permute
        def epoch(n):
            return np.random.default_rng([0, 0]).permutation(n)

        def windows(index, n):
            return streams.permute(index, n, [0, 0x70C5, 0])
    n_windows = 30_000_000  # a 60B-token file's windows of 2048 tokens
    index = np.arange(rows) + 5_000_000
    return {"epoch": {str(n): best(lambda n=n: epoch(n), repeat) for n in sizes},
            "windows": best(lambda: windows(index, n_windows), repeat)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    p.add_argument("--rows", type=int, default=512, help="window indices ordered a batch")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--before", help="another ndjax checkout to measure beside this one")
    p.add_argument("--tiny", action="store_true", help="smoke run: 1,000 documents, 1 run")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.tiny:
        a.sizes, a.repeat = [1_000], 1
    if a.child:
        print(json.dumps(measure(a.sizes, a.rows, a.repeat)))
        return
    rows = []
    for name, tree in (("before", a.before), ("this tree", str(ROOT))):
        if tree is None:
            continue
        env = {**os.environ, "PYTHONPATH": tree}
        out = subprocess.run([sys.executable, __file__, "--child", "--sizes",
                              *map(str, a.sizes), f"--rows={a.rows}", f"--repeat={a.repeat}"],
                             cwd=tree, env=env, capture_output=True, text=True, check=True)
        rows.append((name, json.loads(out.stdout.strip().splitlines()[-1])))
    heads = [f"epoch order, {n:,} docs (s)" for n in a.sizes]
    print("| tree | " + " | ".join(heads) + f" | {a.rows} window indices (ms) |")
    print("|:--|" + "--:|" * (len(heads) + 1))
    for name, r in rows:
        cells = [f"{r['epoch'][str(n)]:.3f}" for n in a.sizes]
        print(f"| {name} | " + " | ".join(cells) + f" | {1000 * r['windows']:.2f} |")


if __name__ == "__main__":
    main()
