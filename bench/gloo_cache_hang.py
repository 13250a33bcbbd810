"""How often a 2-process CPU run hangs, with and without the persistent compilation cache.

ndjax turns jax's persistent compilation cache off in multi-process CPU runs
(ndjax/parallel/distributed.py) because executables loaded from it hung gloo's set-up.
This script measures it, so the workaround can be re-checked on a newer jax:
each run is 2 train.py processes x 4 CPU devices (context=4 x tensor=2, the
ring crossing processes) sharing one cache directory, warmed by the first run.

    PYTHONPATH=. python bench/gloo_cache_hang.py --runs 8 --steps 6 --timeout 60
    PYTHONPATH=. python bench/gloo_cache_hang.py --tiny   # smoke run: 1 run per mode, 2 steps

"kept" sets NDJAX_KEEP_CPU_COMPILATION_CACHE=1 (the cache is used); "off" is
what ndjax does. A run that has not ended after --timeout seconds counts as hung.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

from ndjax.runtime.children import stop_children_on_signals

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--config.model.vocab_size=256", "--config.model.dim=64", "--config.model.n_layers=2",
        "--config.model.n_heads=8", "--config.model.n_kv_heads=4", "--config.model.ffn_dim=128",
        "--config.train.batch_size=8", "--config.train.seq_len=32",
        "--config.data.source=synthetic", "--config.log.tensorboard=False",
        "--config.mesh.fsdp=1", "--config.mesh.context=4", "--config.mesh.tensor=2",
        "--config.runtime.cpu_devices=4", "--config.runtime.num_processes=2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(workdir: str, env: dict, steps: int, timeout: float) -> tuple[str, float]:
    port = free_port()
    # stderr to files (a pipe nobody reads while we wait could fill and block the
    # process), so that a failed run can say why.
    logs = [f"{workdir}.{i}.err" for i in range(2)]
    procs = []
    for i in range(2):
        with open(logs[i], "w") as err:
            procs.append(subprocess.Popen(
                [sys.executable, os.path.join(ROOT, "train.py"), f"--workdir={workdir}",
                 *TINY, f"--config.train.steps={steps}",
                 f"--config.runtime.coordinator=127.0.0.1:{port}",
                 f"--config.runtime.process_id={i}"],
                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err))
    start = time.monotonic()
    while time.monotonic() - start < timeout and any(p.poll() is None for p in procs):
        time.sleep(0.5)
    elapsed = time.monotonic() - start
    if any(p.poll() is None for p in procs):
        for p in procs:
            p.kill()
            p.wait()
        return "hung", elapsed
    if all(p.returncode == 0 for p in procs):
        return "ok", elapsed
    for i, p in enumerate(procs):
        if p.returncode != 0:
            with open(logs[i]) as f:
                tail = f.read().splitlines()[-15:]
            print(f"# process {i} exited {p.returncode}; its stderr ends:", *tail,
                  sep="\n# ", file=sys.stderr, flush=True)
    return "failed", elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--tiny", action="store_true",
                        help="smoke run: 1 run per mode, 2 steps, hung after 120 s")
    args = parser.parse_args()
    stop_children_on_signals()  # a stopped run stops its train.py processes
    if args.tiny:
        # Whether the script still runs and ndjax's mode ends, not the hang rate: one
        # run per mode. A run takes 15-35 s on 2 idle cores and up to 75 s beside a
        # test suite (compiling, twice at once); tests/test_bench.py fails if ndjax's
        # mode has not ended by then, so 120 s.
        args.runs, args.steps, args.timeout = 1, 2, 120.0
    print(f"{args.runs} runs per mode, {args.steps} steps, hung = not ended after "
          f"{args.timeout:g} s")
    print("| mode | ok | hung | failed | median s of ok runs |")
    print("|:-----|---:|-----:|-------:|--------------------:|")
    for mode in ("kept", "off"):
        outcomes = []
        with tempfile.TemporaryDirectory(prefix="ndjax-bench-") as work:
            # A fresh cache per mode, removed with the runs' directories (the test
            # suite runs this script every time, so it must not leave caches behind).
            env = {**os.environ, "PYTHONPATH": ROOT,
                   "JAX_COMPILATION_CACHE_DIR": os.path.join(work, "cache")}
            if mode == "kept":
                env["NDJAX_KEEP_CPU_COMPILATION_CACHE"] = "1"
            for k in range(args.runs):
                outcomes.append(one_run(os.path.join(work, str(k)), env, args.steps,
                                        args.timeout))
        ok = sorted(t for o, t in outcomes if o == "ok")
        median = f"{ok[len(ok) // 2]:.1f}" if ok else "-"
        counts = [sum(o == x for o, _ in outcomes) for x in ("ok", "hung", "failed")]
        print(f"| {mode} | {counts[0]} | {counts[1]} | {counts[2]} | {median} |", flush=True)


if __name__ == "__main__":
    main()
