"""LoRA against full fine-tuning, side by side in one run: the memory per GPU of the
train step compiled by XLA's GPU compiler for GPUs this machine does not have
(``ndjax compile``'s figures; the gpu-compile extra), with QLoRA (the same
adapters over an NF4 base) beside them, and the tokens/s of full fine-tuning and LoRA
on this machine's CPUs on the tiny model.

    PYTHONPATH=. python bench/lora.py          # Llama 3 8B and 70B, ~10 minutes on 2 cores
    PYTHONPATH=. python bench/lora.py --tiny   # smoke run (CI: tests/test_gpu_compile.py)

Full fine-tuning keeps float32 weights and Adam moments (model.param_dtype=auto); LoRA
(r=16 on every projection, model.lora) a bfloat16 base and float32 adapters with
their moments; QLoRA the base's projections in NF4 (4 bits and a float32 scale per 64
values; embeddings, norms and LM head in bfloat16). All compute in bfloat16 with full
remat, batch 1 x 4096 per data-parallel rank. The memory is XLA's: arguments (weights,
optimizer state, batch) plus temporaries, without cuBLAS/cuDNN workspaces
(docs/compile-and-plan.md).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

GiB = 2**30
# (preset, hardware, GPUs, mesh (replica, fsdp, context, tensor), seq_len)
MEMORY = [
    ("llama3_8b", "h100", 1, (1, 1, 1, 1), 4096),
    ("llama3_70b", "h100", 8, (1, 8, 1, 1), 4096),
    ("llama3_70b", "h200", 8, (1, 8, 1, 1), 4096),
]
TINY_MEMORY = [("tiny", "h100", 8, (1, 4, 1, 2), 256)]
LORA = dict(rank=16, alpha=32.0, target_modules="all-linear")
# QLoRA: the same adapters over an NF4 base, a float32 scale per 64 values (bitsandbytes'
# default block; the tiny model's head_dim of 32 takes 32).
QLORA = dict(LORA, quantize="nf4", quant_block=64)
TRAININGS = {"full": None, "LoRA r=16": LORA, "QLoRA r=16, NF4": QLORA}


def config(preset: str, mesh: tuple[int, ...], seq: int, lora: bool | dict, dp_batch: int = 1):
    from ndjax.config import default_config
    c = default_config()
    c.mesh.update(dict(zip(("replica", "fsdp", "context", "tensor"), mesh, strict=True)))
    c.model.update(dict(preset=preset, remat="full", dtype="bfloat16"))
    if lora:
        c.model.lora.update(LORA if lora is True else lora)
        if preset == "tiny" and c.model.lora.quantize != "none":
            c.model.lora.quant_block = 32
    c.train.update(dict(batch_size=dp_batch * mesh[0] * mesh[1], seq_len=seq))
    c.data.source = "synthetic"
    return c


def memory(cases: list) -> None:
    from ndjax.verbs.compile import compile_for

    print("| model | GPUs | mesh | seq | training | frozen base MiB | weights + optimizer + "
          "batch GiB | temporaries GiB | total GiB | of the GPU's | / full | compile s |")
    print("|:--|:--|:--|--:|:--|--:|--:|--:|--:|--:|--:|--:|")
    for preset, hardware, n, mesh, seq in cases:
        full = None
        for training, lora in TRAININGS.items():
            r = compile_for(config(preset, mesh, seq, lora or False), hardware, n)
            total = r["argument_bytes"] + r["temp_bytes"]
            full = full or total
            named = " x ".join(f"{a}={s}" for a, s in r["mesh"].items() if s > 1) or "1"
            base = f"{r['frozen_param_bytes'] / 2**20:,.1f}" if lora else "-"
            ratio = f"{total / full:.2f}x" if lora else ""
            print(f"| {preset} | {n} x {r['gpu']} | {named} | {seq} | {training} | {base} | "
                  f"{r['argument_bytes'] / GiB:.1f} | {r['temp_bytes'] / GiB:.1f} | "
                  f"{total / GiB:.1f} | {total / r['gpu_memory_bytes']:.0%} | {ratio} | "
                  f"{r['compile_s']:.0f} |", flush=True)


def cpu_speed(steps: int, layers: int | None = None, batch: int = 8, seq: int = 256) -> None:
    """Tokens/s of the tiny model (``layers``: of that many layers) on one CPU device,
    full fine-tuning and LoRA alternating over 3 rounds (the median of each), float32 so
    that the CPU's own speed is timed."""
    import jax
    import numpy as np

    from ndjax.data.synthetic import SyntheticSource
    from ndjax.experiment import Experiment

    def tiny(lora: bool):
        c = config("tiny", (1, 1, 1, 1), seq, lora, dp_batch=batch)
        c.model.update(dict(dtype="float32", param_dtype="float32"))
        if layers:
            c.model.n_layers = layers
        return c

    exps = {lora: Experiment.from_config(tiny(lora), jax.devices()[:1]) for lora in (False, True)}
    states = {lora: e.init_state() for lora, e in exps.items()}
    one = SyntheticSource(exps[False].model_cfg.vocab_size, seq, 0).rows(0, 0, batch)
    seconds = {False: [], True: []}
    for _ in range(3):
        for lora, exp in exps.items():
            step = exp.compiled_step
            device_batch = exp.device_batch(one)
            states[lora], metrics = step(states[lora], device_batch)  # warm
            jax.block_until_ready(metrics)
            start = time.perf_counter()
            for _ in range(steps):
                states[lora], metrics = step(states[lora], device_batch)
            jax.block_until_ready(metrics)
            seconds[lora].append((time.perf_counter() - start) / steps)
    tokens = batch * seq
    full, lora = (float(np.median(seconds[k])) for k in (False, True))
    print(f"\n| tiny model ({exps[False].model_cfg.n_layers} layers), 1 CPU device, batch "
          f"{batch} x {seq}, float32 | step s | tokens/s |")
    print("|:--|--:|--:|")
    print(f"| full fine-tuning | {full:.3f} | {tokens / full:,.0f} |")
    print(f"| LoRA r=16, all-linear | {lora:.3f} | {tokens / lora:,.0f} |")
    print(f"\nLoRA / full tokens/s: {full / lora:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny model, for a smoke run")
    args = parser.parse_args()
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    print(f"# bench/lora.py{' --tiny' if args.tiny else ''}, {datetime.date.today()}, "
          f"{platform.node() and 'this machine'}: {os.cpu_count()} CPUs, "
          f"Python {sys.version.split()[0]}")
    memory(TINY_MEMORY if args.tiny else MEMORY)
    cpu_speed(*((1, 1, 2, 64) if args.tiny else (10,)))


if __name__ == "__main__":
    main()
