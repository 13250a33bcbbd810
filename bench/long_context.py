"""Long-context records, compiled for H100s on a machine without one: the ring and
all-to-all side by side, with and without activation offload.

Each case compiles the whole train step (``ndjax compile --json``, one
subprocess each: XLA's GPU compiler for N H100s, nothing runs) and reads its memory
per device, host memory (``model.remat=offload``) and collectives. The step time is
``ndjax.hardware.roofline``'s: model FLOPs plus what the remat reruns at the bf16 peak,
every collective's bytes over NVLink or the network, and the offloaded layer
inputs out and back over PCIe; serial (an upper bound) and overlapped.

Whether compute hides each hop, per layer and forward pass, by formula:

* ring: each of the c - 1 hops sends one k/v block, 2 x (seq / c) x kv heads x
  head_dim bf16 per device, while the shard computes its 2 zigzag blocks of
  (seq / 2c)^2 query-key pairs for its heads; the ring's hops cross the network
  where the context group spans nodes.
* all-to-all: q, k, v (kv heads repeated where a device has fewer than c) and the
  output, (c - 1) / c of each device's seq / c tokens of them, against the
  attention over the whole sequence for 1 / c of its heads. Attention waits for
  them (no overlap inside a layer), so the ratio is what the layer pays.

    PYTHONPATH=. python bench/long_context.py           # the records, ~5 minutes on 2 cores
    PYTHONPATH=. python bench/long_context.py --tiny    # smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time

from ndjax.hardware import roofline
from ndjax.hardware.flops import flops_per_token
from ndjax.models.registry import config_from_preset
from ndjax.runtime.children import stop_children_on_signals

GiB = 2**30
PER_NODE = 8

# (preset, devices, seq_len, batch, mesh, rules, remat)
CASES = [
    ("llama3_8b", 8, 262_144, 1, dict(context=8), "default", "full"),
    ("llama3_8b", 8, 1_048_576, 1, dict(context=8), "default", "full"),
    ("llama3_8b", 8, 1_048_576, 1, dict(context=8), "default", "offload"),
    ("llama3_8b", 64, 4_194_304, 1, dict(context=64), "default", "full"),
    ("llama3_8b", 64, 4_194_304, 1, dict(context=64), "default", "offload"),
    ("llama3_70b", 64, 1_048_576, 1, dict(context=8, tensor=8), "default", "offload"),
    ("llama3_70b", 64, 1_048_576, 1, dict(context=8, tensor=8), "megatron_sp", "full"),
    ("llama3_70b", 64, 1_048_576, 1, dict(context=8, tensor=8), "megatron_sp", "offload"),
]
TINY = [("llama3_8b", 8, 32_768, 1, dict(context=8), "default", "offload")]


def compile_one(preset, devices, seq, batch, mesh, rules, remat, cp) -> dict:
    sizes = {**dict(replica=1, fsdp=1, context=1, tensor=1), **mesh}
    cmd = [sys.executable, "-m", "ndjax", "compile", "--config=configs/llama_fsdp_cp.py",
           "--hardware=h100", f"--devices={devices}", "--json", "--mem_fraction=0.75",
           f"--config.model.preset={preset}", f"--config.train.seq_len={seq}",
           f"--config.train.batch_size={batch}", f"--config.model.remat={remat}",
           f"--config.model.cp_impl={cp}", f"--config.rules={rules}",
           *(f"--config.mesh.{a}={s}" for a, s in sizes.items())]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode:
        return {"error": (r.stderr.strip().splitlines() or ["?"])[-1][:400]}
    return json.loads(r.stdout)


def hops(cfg, seq: int, mesh: dict, cp: str, hw: roofline.Hardware) -> str:
    """Per layer, forward: compute against the bytes it waits for (see the docstring).
    ``cfg``: the model's ``DecoderConfig``."""
    c, t = mesh.get("context", 1), mesh.get("tensor", 1)
    heads, kv, hd = cfg.n_heads // t, max(cfg.n_kv_heads // t, 1), cfg.hd
    link = hw.nvlink_gbs if c * t <= PER_NODE else hw.network_gbs
    peak = hw.peak_tflops * 1e12
    if cp == "ring":
        block = 2 * (seq // c) * kv * hd * 2
        piece = seq // (2 * c)
        compute = 2 * 4 * piece * piece * heads * hd / peak
        send = block / (link * 1e9)
        return (f"hop {send * 1e3:.2f} ms vs blocks {compute * 1e3:.2f} ms: "
                + ("hidden" if compute >= send else "NOT hidden"))
    repeat = c // math.gcd(kv, c)
    sent = (c - 1) / c * (seq // c) * (2 * heads + 2 * kv * repeat) * hd * 2
    attend = 4 * seq * seq / 2 * (heads / c) * hd / peak
    wait = sent / (link * 1e9)
    return (f"all-to-alls {wait * 1e3:.2f} ms vs attention {attend * 1e3:.2f} ms "
            f"({wait / attend:.1%})")


def estimate(r: dict, cfg, seq: int, batch: int, remat: str, hw: roofline.Hardware
             ) -> roofline.Estimate:
    tokens = seq * batch
    rerun = sum(roofline.recomputed_forward_flops(cfg, seq, remat).values()) * tokens
    link = roofline.traffic(r["collectives"], PER_NODE)
    return roofline.estimate(hw, link, flops_per_token(cfg, seq) * tokens, tokens, r["devices"],
                             remat, rerun, host_bytes=r["host_bytes"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="one small case (smoke run)")
    args = parser.parse_args()
    stop_children_on_signals()  # a stopped run stops the compile it waits on
    hw = roofline.HARDWARE["h100"]
    budget = 0.75 * hw.memory_bytes
    print(f"# bench/long_context.py{' --tiny' if args.tiny else ''}, "
          f"{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} CPUs; compiled "
          f"for {hw.name} (budget 75%: {budget / GiB:.2f} GiB)\n")
    print("| model | GPUs | seq | layout | rules | remat | CP | GiB/device | fits | host GiB | "
          "step s (overlapped) | tokens/s/GPU | MFU | per layer, forward | compile s |")
    print("|:--|--:|--:|:--|:--|:--|:--|--:|:--|--:|--:|--:|--:|:--|--:|")
    for preset, n, seq, batch, mesh, rules, remat in (TINY if args.tiny else CASES):
        for cp in ("ring", "all_to_all"):
            start = time.perf_counter()
            r = compile_one(preset, n, seq, batch, mesh, rules, remat, cp)
            layout = " x ".join(f"{a}={s}" for a, s in mesh.items())
            row = [preset, str(n), f"{seq:,}", layout, rules, remat, cp]
            if "error" in r:
                print("| " + " | ".join(row + [r["error"]] + [""] * 7) + " |")
                continue
            cfg = config_from_preset("llama", preset)
            e = estimate(r, cfg, seq, batch, remat, hw)
            # fits: ndjax compile's verdict, device and host memory within the budget.
            row += [f"{r['memory_bytes'] / GiB:.2f}", "yes" if r["fits"] else "no",
                    f"{r['host_bytes'] / GiB:.0f}",
                    f"{e.serial_s:.1f} ({e.overlapped_s:.1f})",
                    f"{e.tokens_per_s() / n:,.0f}", f"{e.mfu():.0%}",
                    hops(cfg, seq, mesh, cp, hw), f"{time.perf_counter() - start:.0f}"]
            print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
