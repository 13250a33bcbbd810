"""Memory per device of the planner's layouts: XLA's CPU compiler (the planner's
stand-in) next to XLA's GPU compiler for the GPUs themselves, side by side.

For each case below (the top rows BENCHMARKS.md records for ``ndjax plan``,
and two without remat),
the same train step is compiled twice through ``ndjax.planning.planner.measure``: on N
simulated CPU devices with the planner's CPU options, the fused attention kernel
compiled as ``tiled``; and for N H100s (``ndjax.hardware.gpu_target``, the gpu-compile
extra) with the train step's GPU options and the kernel ``auto`` picks there. The
ratio CPU / GPU is the error band of a CPU-compiled plan.

    PYTHONPATH=. python bench/compile_targets.py            # 11 layouts, ~4 minutes on 2 cores
    PYTHONPATH=. python bench/compile_targets.py --tiny     # smoke run
    PYTHONPATH=. python bench/compile_targets.py --kernels  # attention kernels, GPU only

``--kernels``: the whole ``llama3_8b`` train step on 8 H100s (fsdp=4 x tensor=2,
batch 8, ``configs/llama_fsdp_tp.py``), GPU-compiled, for each attention kernel at
4096 and 16384 tokens, remat none and full: ``ndjax compile``'s figures.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

GiB = 2**30

# (model, devices, batch, seq, remat, [(replica, fsdp, context, tensor), ...])
CASES = [
    ("llama3_8b", 8, 16, 8192, "full", [(1, 8, 1, 1), (2, 4, 1, 1), (1, 4, 2, 1)]),
    ("llama3_8b", 64, 128, 8192, "full", [(8, 8, 1, 1), (8, 4, 2, 1), (8, 2, 4, 1)]),
    ("llama3_70b", 64, 64, 8192, "full", [(1, 32, 1, 2), (1, 16, 2, 2), (1, 8, 4, 2)]),
    # Without remat, where the CPU compiler's widened bf16 activations show most.
    ("llama3_8b", 8, 8, 4096, "none", [(1, 4, 1, 2)]),
    ("llama3_8b", 64, 128, 4096, "none", [(8, 8, 1, 1)]),
]
# One layout with both sharded axes: every path of a row once (CI's smoke run,
# tests/test_gpu_compile.py).
TINY = [("tiny", 8, 8, 256, "full", [(1, 4, 1, 2)])]


def kernels(hardware: str) -> None:
    from ndjax.config import default_config
    from ndjax.verbs.compile import compile_for

    print("| remat | seq | kernel | arguments GiB | temporaries GiB | temp / tiled's | "
          "compile s |")
    print("|:--|--:|:--|--:|--:|--:|--:|")
    for remat in ("none", "full"):
        for seq in (4096, 16384):
            temps = {}
            for impl in ("tiled", "cudnn", "pallas"):
                c = default_config()
                c.mesh.update(dict(fsdp=4, tensor=2))
                c.model.update(dict(preset="llama3_8b", remat=remat, attn_impl=impl))
                c.train.update(dict(batch_size=8, seq_len=seq))
                c.data.source = "synthetic"
                r = compile_for(c, hardware, 8)
                temps[impl] = r["temp_bytes"]
                print(f"| {remat} | {seq} | {impl} | {r['argument_bytes'] / GiB:.1f} | "
                      f"{r['temp_bytes'] / GiB:.1f} | {temps[impl] / temps['tiled']:.2f}x | "
                      f"{r['compile_s']:.0f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny model, for a smoke run")
    parser.add_argument("--kernels", action="store_true", help="attention kernels, 8B step")
    parser.add_argument("--hardware", default="h100")
    args = parser.parse_args()
    cases = TINY if args.tiny else CASES
    most = max(c[1] for c in cases)
    os.environ["JAX_PLATFORMS"] = "cpu"
    from ndjax.runtime.console import native_stderr

    with native_stderr():
        import jax

        jax.config.update("jax_num_cpu_devices", most)
        jax.devices()
    from ndjax.config import default_config
    from ndjax.hardware import gpu_target, roofline
    from ndjax.planning import planner

    gpu_target.require()
    if args.kernels:
        print(f"`PYTHONPATH=. python bench/compile_targets.py --kernels` on "
              f"{platform.processor() or platform.machine()} (no GPU), jax {jax.__version__}, "
              f"{datetime.date.today().isoformat()}; compiled for 8 x "
              f"{roofline.HARDWARE[args.hardware].name}")
        print()
        kernels(args.hardware)
        return
    hw = roofline.HARDWARE[args.hardware]
    start = time.perf_counter()
    print(f"`PYTHONPATH=. python bench/compile_targets.py{' --tiny' if args.tiny else ''}` on "
          f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores, no GPU), "
          f"jax {jax.__version__}, {datetime.date.today().isoformat()}; GPU: {hw.name}")
    print()
    print("| model | GPUs | batch x seq | layout | CPU compile: attention | CPU GiB/device | "
          "GPU compile: attention | GPU GiB/device (args + temp) | CPU / GPU | "
          "CPU s | GPU s |")
    print("|:--|--:|:--|:--|:--|--:|:--|--:|--:|--:|--:|")
    for model, n, batch, seq, remat, layouts in cases:
        config = default_config()
        config.model.preset = model
        config.model.remat = remat
        config.data.source = "synthetic"
        config.train.update(dict(batch_size=batch, seq_len=seq))
        gpus = gpu_target.devices(hw, n)
        for degrees in layouts:
            layout = planner.Layout(*degrees, remat=remat)
            row = []
            for devices, target in ((jax.devices()[:n], None), (gpus, args.hardware)):
                checked = planner.check(config, layout, devices, hw)
                r = planner.measure(checked.config.to_json(sort_keys=True), n, target)
                if "error" in r:
                    row.append((checked.attention, None, None, r["error"]))
                    continue
                row.append((checked.attention, r["arguments"], r["temporaries"], r["compile_s"]))
            (cpu_attn, cpu_a, cpu_t, cpu_s), (gpu_attn, gpu_a, gpu_t, gpu_s) = row
            cpu = None if cpu_a is None else (cpu_a + cpu_t) / GiB
            gpu = None if gpu_a is None else (gpu_a + gpu_t) / GiB
            print(f"| {model} | {n} | {batch} x {seq} | {layout.mesh} | {cpu_attn} | "
                  f"{'-' if cpu is None else f'{cpu:.1f}'} | {gpu_attn} | "
                  + ("-" if gpu is None else f"{gpu:.1f} ({gpu_a / GiB:.1f} + {gpu_t / GiB:.1f})")
                  + f" | {'-' if not (cpu and gpu) else f'{cpu / gpu:.2f}x'} | "
                  f"{cpu_s} | {gpu_s} |", flush=True)
    print(f"\n{time.perf_counter() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
