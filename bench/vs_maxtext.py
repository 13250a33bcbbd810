"""ndjax against MaxText on issue 33's CPU job: time to the first step, step times, and
the collectives of the compiled train step, side by side, on one jax.

The job: Llama, vocab 4096, dim 256, 4 layers (unrolled), 8 heads / 4 kv heads of 32,
MLP 1024, float32, batch 8 x 256, synthetic data, AdamW at 3e-3, no remat (MaxText's
``minimal``: every matmul saved), dense attention (MaxText's ``dot_product``), on
``--mesh R F T`` = replica (MaxText's data) x fsdp x tensor simulated CPU devices. Each
run is a fresh process with an empty compilation cache; rounds alternate the two. A
run's "first step" is the wall time from its spawn to the line that reports step 1
(ndjax's ``step 1/N``, MaxText's ``completed step: 0``): both print it once that step's
metrics are read, after the next step was dispatched. Step times are each program's own
(ndjax's metrics.jsonl ``step_time``, MaxText's ``seconds``). ``--collectives`` also
dumps each compiled train step (XLA's ``--xla_dump_to``) and counts its collectives
with ``ndjax.parallel.collectives``: kind, times a step, bytes a device a step.

MaxText is not an ndjax dependency: ``--maxtext_python`` names an interpreter of a
virtualenv that has both MaxText and ndjax (and the jax both run on). Run from the repo
root:

    PYTHONPATH=. python bench/vs_maxtext.py --maxtext_python VENV/bin/python \\
        --rounds 3 --mesh 2 2 2 --steps 16 --collectives
    PYTHONPATH=. python bench/vs_maxtext.py --tiny   # smoke run: ndjax's side alone
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = dict(vocab=4096, dim=256, layers=4, heads=8, kv_heads=4, head_dim=32, mlp=1024,
           batch=8, seq=256)
TINY = dict(vocab=256, dim=64, layers=2, heads=8, kv_heads=4, head_dim=8, mlp=128,
            batch=8, seq=32)
STEP_LINE = {"ndjax": re.compile(r"^step 1/\d+"),
             "maxtext": re.compile(r"completed step: 0,")}
MAXTEXT_STEP = re.compile(r"completed step: (\d+), seconds: ([\d.]+)")


def ndjax_cmd(python: str, job: dict, mesh: list[int], steps: int, workdir: str) -> list[str]:
    r, f, t = mesh
    return [python, os.path.join(ROOT, "train.py"), f"--workdir={workdir}",
            f"--config.model.vocab_size={job['vocab']}", f"--config.model.dim={job['dim']}",
            f"--config.model.n_layers={job['layers']}", f"--config.model.n_heads={job['heads']}",
            f"--config.model.n_kv_heads={job['kv_heads']}",
            f"--config.model.head_dim={job['head_dim']}",
            f"--config.model.ffn_dim={job['mlp']}", "--config.model.dtype=float32",
            "--config.model.attn_impl=dense", "--config.model.scan_layers=False",
            f"--config.train.batch_size={job['batch']}", f"--config.train.seq_len={job['seq']}",
            f"--config.train.steps={steps}", "--config.data.source=synthetic",
            f"--config.mesh.replica={r}", f"--config.mesh.fsdp={f}",
            "--config.mesh.context=1", f"--config.mesh.tensor={t}",
            f"--config.runtime.cpu_devices={r * f * t}", "--config.log.every=1",
            "--config.checkpoint.every=0", "--config.checkpoint.async_save=False",
            "--config.runtime.compilation_cache=off"]


def maxtext_cmd(python: str, job: dict, mesh: list[int], steps: int, workdir: str) -> list[str]:
    # Where MaxText is installed: asked of its own interpreter.
    base = subprocess.run([python, "-c", "import maxtext, os; print(os.path.dirname("
                           "maxtext.__file__))"], capture_output=True, text=True, check=True)
    r, f, t = mesh
    n = r * f * t
    return [python, "-m", "maxtext.trainers.pre_train.train",
            os.path.join(base.stdout.strip(), "configs", "base.yml"), "run_name=bench",
            f"base_output_directory={workdir}", "hardware=cpu", "skip_jax_distributed_system=true",
            "dataset_type=synthetic", "enable_checkpointing=false", "enable_tensorboard=false",
            f"jax_cache_dir={os.path.join(workdir, 'xla')}", f"steps={steps}",
            f"vocab_size={job['vocab']}", f"base_emb_dim={job['dim']}",
            f"base_num_decoder_layers={job['layers']}", f"base_num_query_heads={job['heads']}",
            f"base_num_kv_heads={job['kv_heads']}", f"head_dim={job['head_dim']}",
            f"base_mlp_dim={job['mlp']}", f"max_target_length={job['seq']}",
            f"per_device_batch_size={job['batch'] / n}", "dtype=float32",
            "weight_dtype=float32", "remat_policy=minimal", "scan_layers=false",
            "attention=dot_product", "learning_rate=3e-3", f"ici_data_parallelism={r}",
            f"ici_fsdp_parallelism={f}", f"ici_tensor_parallelism={t}"]


def run(which: str, python: str, job: dict, mesh: list[int], steps: int,
        dump: str | None) -> dict:
    """One fresh process: seconds from spawn to step 1's line, and step times."""
    n = mesh[0] * mesh[1] * mesh[2]
    with tempfile.TemporaryDirectory(prefix=f"vs-{which}-") as workdir:
        build = ndjax_cmd if which == "ndjax" else maxtext_cmd
        cmd = build(python, job, mesh, steps, workdir)
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        flags = [f"--xla_force_host_platform_device_count={n}"] if which == "maxtext" else []
        if dump:
            flags += [f"--xla_dump_to={dump}", "--xla_dump_hlo_as_text",
                      "--xla_dump_hlo_module_re=.*train_step.*"]
        if flags:
            env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), *flags]).strip()
        spawned = time.time()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        first, lines = None, []
        for line in proc.stdout:
            lines.append(line)
            if first is None and STEP_LINE[which].search(line):
                first = time.time() - spawned
        if proc.wait() or first is None:
            sys.stderr.write("".join(lines[-40:]))
            raise SystemExit(f"{which} failed (exit {proc.returncode})")
        if which == "ndjax":
            with open(os.path.join(workdir, "metrics.jsonl")) as f:
                times = [r["step_time"] for r in map(json.loads, f) if "step_time" in r]
        else:
            times = [float(m.group(2)) for m in map(MAXTEXT_STEP.search, lines) if m]
    return {"first": first, "steps": times[1:]}


def tally(dump: str) -> dict[str, dict[str, int]]:
    """``collectives.summarize`` of the dumped train step: per kind, times a step
    (``executed``) and bytes a device a step (``bytes``; the job is float32, so no bytes
    were widened by the CPU compiler)."""
    from ndjax.parallel.collectives import collectives, summarize

    files = sorted(glob.glob(os.path.join(dump, "*train_step*after_optimizations.txt")))
    if not files:
        raise SystemExit(f"no optimized train step dumped in {dump}")
    with open(files[-1]) as f:
        return summarize(collectives(f.read()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--maxtext_python", help="an interpreter with MaxText and ndjax installed")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--mesh", type=int, nargs=3, default=[2, 2, 2], metavar=("R", "F", "T"))
    p.add_argument("--collectives", action="store_true",
                   help="also count each compiled train step's collectives")
    p.add_argument("--tiny", action="store_true", help="smoke run: ndjax alone, tiny model")
    a = p.parse_args()
    from ndjax.runtime.children import stop_children_on_signals
    stop_children_on_signals()
    job = TINY if a.tiny else JOB
    sides = ["ndjax"] + ([] if a.tiny or not a.maxtext_python else ["maxtext"])
    python = {"ndjax": a.maxtext_python or sys.executable, "maxtext": a.maxtext_python}
    jax_version = subprocess.run([python["ndjax"], "-c", "import jax; print(jax.__version__)"],
                                 capture_output=True, text=True).stdout.strip()
    rounds, steps = (1, 3) if a.tiny else (a.rounds, a.steps)
    print(f"# ndjax vs MaxText, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{os.cpu_count()} cores, jax {jax_version}; job {job}; mesh replica x fsdp x "
          f"tensor = {' x '.join(map(str, a.mesh))}; {rounds} round(s), {steps} steps",
          flush=True)
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    for _ in range(rounds):
        for side in sides:
            runs[side].append(run(side, python[side], job, a.mesh, steps, None))
    print("\n| program | first step s, median (each run) | step s after the first, "
          "median (min-max) |")
    print("|:--|--:|--:|")
    for side in sides:
        firsts = [r["first"] for r in runs[side]]
        times = [t for r in runs[side] for t in r["steps"]]
        print(f"| {side} | {statistics.median(firsts):.2f} "
              f"({', '.join(f'{x:.2f}' for x in firsts)}) | {statistics.median(times):.3f} "
              f"({min(times):.3f}-{max(times):.3f}) |")
    if a.collectives or a.tiny:
        counts = {}
        for side in sides:
            with tempfile.TemporaryDirectory(prefix=f"vs-{side}-hlo-") as dump:
                run(side, python[side], job, a.mesh, 2, dump)
                counts[side] = tally(dump)
        kinds = sorted({k for c in counts.values() for k in c})
        print("\n| collective | " + " | ".join(f"{s}: times, MiB a device" for s in sides)
              + " |")
        print("|:--|" + "--:|" * len(sides))
        for k in kinds:
            none = {"executed": 0, "bytes": 0}
            cells = [f"{counts[s].get(k, none)['executed']}, "
                     f"{counts[s].get(k, none)['bytes'] / 2**20:.2f}" for s in sides]
            print(f"| {k} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
