"""Peak host memory (RSS) of a Hugging Face export and of importing it back.

A ~110M-parameter Llama (vocab 32000, dim 768, 12 layers, 12 heads, FFN 2048,
tied embeddings), float32 parameters on fsdp=4 x tensor=2 over 8 simulated CPU
devices, is exported as bfloat16 (``hf.export``) once per shard size, and each
export is imported back (``hf.load_params``) into float32. Each phase runs in a
fresh process. "before" is the process's RSS just before the phase, after
``malloc_trim`` (imports, the Experiment, and for export the parameters
themselves: on the CPU backend device memory is host memory); "phase peak" is
the highest RSS during the phase (``VmHWM`` after resetting it through
``/proc/self/clear_refs``); "added" is their difference, what the phase itself
costs the host. For import that includes the float32 parameters it creates and
the checkpoint pages the process has mapped while it reads ("mapped": the
highest ``RssFile`` growth, sampled every millisecond; page cache, reclaimable).
"process peak" is the child's whole-life ``ru_maxrss`` (``os.wait4``).

Run from the repo root:

    PYTHONPATH=. python bench/hf_memory.py [--shards 60MB default]
    PYTHONPATH=. python bench/hf_memory.py --tiny   # smoke run: 2-layer dim-64 model
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import threading

from ndjax.runtime.children import stop_children_on_signals

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL = dict(vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_dim=2048,
            tie_embeddings=True)
TINY = dict(vocab_size=256, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=128,
            tie_embeddings=False)
MESH = dict(replica=1, fsdp=4, context=1, tensor=2)
MIB = 2**20
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9}


def shard_bytes(text: str) -> int | None:
    """'60MB' -> 60_000_000; 'default' -> None (hf.export's own default)."""
    if text == "default":
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(KB|MB|GB)", text)
    if not m:
        raise SystemExit(f"--shards {text!r}: write e.g. 60MB, 40KB or default")
    return int(float(m[1]) * _UNITS[m[2]])


# ----- in the child process ---------------------------------------------------------


def _status() -> dict[str, int]:
    """VmRSS, VmHWM and RssFile of this process, in bytes (Linux)."""
    with open("/proc/self/status") as f:
        return {k: int(v) * 1024 for k, v in
                re.findall(r"^(VmRSS|VmHWM|RssFile):\s+(\d+) kB", f.read(), re.M)}


class _FileSampler(threading.Thread):
    """The highest RssFile seen while it runs: no kernel counter keeps that peak."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = _status()["RssFile"]
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.001):
            self.peak = max(self.peak, _status()["RssFile"])

    def stop(self) -> int:
        self.done.set()
        self.join()
        return max(self.peak, _status()["RssFile"])


def _start_phase() -> tuple[dict[str, int], _FileSampler]:
    # Freed heap that malloc still holds would count in "before" and hide the
    # phase's own allocations, which reuse it: give it back first.
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS: the peak from here on is the phase's
    sampler = _FileSampler()
    sampler.start()
    return _status(), sampler


def _config(dims: dict, init_from: str | None):
    from ndjax.config import default_config

    c = default_config()
    c.mesh.update(MESH)
    c.data.source = "synthetic"
    if init_from:
        c.model.init_from = init_from  # the checkpoint's config.json sets the dims
    else:
        c.model.update(dims)
    return c


def _random_params(exp):
    """Parameters in their sharding (no optimizer state), one small jit per leaf."""
    import jax

    keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(exp.param_shapes))))

    def make(shape, sharding):
        return jax.jit(lambda k: 0.02 * jax.random.normal(k, shape.shape, shape.dtype),
                       out_shardings=sharding)(next(keys))
    return jax.block_until_ready(
        jax.tree.map(make, exp.param_shapes, exp.state_sharding.params))


def child(phase: str, directory: str, dims: dict, limit: int | None) -> dict:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    from ndjax.experiment import Experiment
    from ndjax.runs import hf

    if phase == "export":
        exp = Experiment.from_config(_config(dims, None))
        params = _random_params(exp)
        before, sampler = _start_phase()
        kwargs = {} if limit is None else dict(shard_bytes=limit)
        hf.export(params, exp.model_cfg, directory, "bfloat16", **kwargs)
    else:
        exp = Experiment.from_config(_config(dims, directory))
        before, sampler = _start_phase()
        params = jax.block_until_ready(
            hf.load_params(exp.checkpoint, exp.param_shapes, exp.state_sharding.params))
    mapped = sampler.stop() - before["RssFile"]
    return dict(before=before["VmRSS"], peak=_status()["VmHWM"], mapped=mapped,
                params=sum(x.size for x in jax.tree.leaves(params)))


# ----- in the parent ----------------------------------------------------------------


def run_phase(phase: str, directory: str, dims: dict, limit: int | None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", phase, directory,
           json.dumps(dims), json.dumps(limit)]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err, text=True)
        # wait4 on this child: its own ru_maxrss, where RUSAGE_CHILDREN would give the
        # running maximum over every child so far.
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            sys.stderr.write(err.read()[-3000:])
            raise SystemExit(f"{phase} failed (exit {proc.returncode})")
        result = json.loads(out.read().strip().splitlines()[-1])
    result["process_peak"] = usage.ru_maxrss * 1024  # KiB on Linux
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", nargs="+", default=["60MB", "default"],
                   help="export.max_shard_size values: 60MB, 40KB, ... or default")
    p.add_argument("--tiny", action="store_true", help="smoke run: a 2-layer dim-64 model")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        phase, directory, dims, limit = a.child
        print(json.dumps(child(phase, directory, json.loads(dims), json.loads(limit))))
        return
    stop_children_on_signals()  # a stopped run stops the phase it waits on
    dims = TINY if a.tiny else FULL
    shards = ["40KB", "default"] if a.tiny and a.shards == p.get_default("shards") else a.shards
    print(f"model {dims}; mesh {MESH}; float32 parameters, bfloat16 files\n")
    print("| phase | max shard | files | before MiB | phase peak MiB | added MiB "
          "| mapped MiB | process peak MiB |")
    print("|:--|:--|--:|--:|--:|--:|--:|--:|")
    n_params = 0
    for shard in shards:
        limit = shard_bytes(shard)
        with tempfile.TemporaryDirectory(prefix="ndjax-hf-bench-") as tmp:
            out = os.path.join(tmp, "hf")
            for phase in ("export", "import"):
                r = run_phase(phase, out, dims, limit)
                n_params = r["params"]
                files = len([n for n in os.listdir(out) if n.endswith(".safetensors")])
                print(f"| {phase} | {shard} | {files} | {r['before'] / MIB:.0f} | "
                      f"{r['peak'] / MIB:.0f} | {(r['peak'] - r['before']) / MIB:.0f} | "
                      f"{r['mapped'] / MIB:.0f} | {r['process_peak'] / MIB:.0f} |", flush=True)
    print(f"\nparameters: {n_params:,} = {4 * n_params / MIB:.0f} MiB in float32, "
          f"{2 * n_params / MIB:.0f} MiB in bfloat16")


if __name__ == "__main__":
    main()
