"""GPT-OSS-120B and DeepSeek V3 compiled for H100s by XLA's GPU compiler (``ndjax compile``'s
figures; the gpu-compile extra, no GPU): memory per device and what one device sends.

    PYTHONPATH=. python bench/open_models.py          # 6 compiles
    PYTHONPATH=. python bench/open_models.py --tiny   # the tiny presets, a smoke run

Rows, bfloat16 compute, ``model.remat=full``, one 4096-token row per GPU:
- ``gpt_oss_120b``, all 36 layers, on 8 H100s with ``mesh.expert=8`` (each GPU holds 16 of
  the 128 experts; the other weights FSDP over the same axis): LoRA r=16 (alpha 32) on
  q, k, v and o over a bfloat16 base, and QLoRA, the same adapters over an NF4 base (the
  experts quantized too). Attention: ``auto`` on a GPU, which with sinks is ``tiled``
  (cuDNN and Pallas have none).
- ``deepseek_v3`` cut to 2 of its 61 layers, its first dense layer and one MoE layer
  (``first_k_dense=1``: 256 experts, MLA, the shared expert), full fine-tuning (float32
  weights and Adam moments), on 8 H100s with ``mesh.expert=8`` and 64 with
  ``mesh.expert=64``, the experts as Mosaic grouped matmuls; at 64 also in capacity mode
  (``model.capacity_factor=1.25``), which bounds what a device can receive.

Columns: the step's arguments (weights, optimizer state, batch) and temporaries per
device as the compile plans them (no cuBLAS/cuDNN workspaces: docs/compile-and-plan.md),
the weights' share of the arguments (trained / frozen base), the bytes one device sends
per step in the experts' all-to-alls (the pairs it has, under balanced routing) and in
every collective, and the collectives by kind (count per step).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform

GiB = 2**30
LORA = dict(rank=16, alpha=32.0, target_modules="q_proj,k_proj,v_proj,o_proj")

# (label, family, preset, GPUs, mesh, model fields, lora fields)
CASES = [
    ("LoRA r=16", "gpt_oss", "gpt_oss_120b", 8, dict(expert=8), {}, LORA),
    ("QLoRA r=16, NF4", "gpt_oss", "gpt_oss_120b", 8, dict(expert=8), {},
     dict(LORA, quantize="nf4", quant_block=64)),
    ("full, 2 of 61 layers", "deepseek_v3", "deepseek_v3", 8, dict(expert=8),
     dict(n_layers=2, first_k_dense=1, moe_impl="mosaic"), {}),
    ("full, 2 of 61 layers", "deepseek_v3", "deepseek_v3", 64, dict(expert=64),
     dict(n_layers=2, first_k_dense=1, moe_impl="mosaic"), {}),
    ("full, 2 of 61 layers, capacity 1.25", "deepseek_v3", "deepseek_v3", 64, dict(expert=64),
     dict(n_layers=2, first_k_dense=1, moe_impl="mosaic", capacity_factor=1.25), {}),
]
# 2 layers each: GPT-OSS's sliding and full one, DeepSeek V3's dense and MoE one.
TINY = [
    ("LoRA r=16", "gpt_oss", "tiny", 8, dict(expert=8), dict(n_layers=2), LORA),
    ("full", "deepseek_v3", "tiny", 8, dict(expert=4, tensor=2), dict(n_layers=2), {}),
]


def row(case) -> str:
    from ndjax.config import default_config
    from ndjax.verbs.compile import compile_for

    label, family, preset, n, mesh, model, lora = case
    c = default_config()
    c.mesh.update(dict(fsdp=n // mesh.get("expert", 1) // mesh.get("tensor", 1), **mesh))
    c.model.update(dict(family=family, preset=preset, remat="full", dtype="bfloat16", **model))
    c.model.lora.update(lora)
    c.train.update(dict(batch_size=n, seq_len=256 if preset == "tiny" else 4096))
    c.data.source = "synthetic"
    r = compile_for(c, "h100", n)
    kinds: dict[str, int] = {}
    for x in r["collectives"]:
        kinds[x["kind"]] = kinds.get(x["kind"], 0) + x["executed"]
    a2a = sum(x["ring_bytes"] * x["executed"] for x in r["collectives"]
              if "all-to-all" in x["kind"])
    every = sum(x["ring_bytes"] * x["executed"] for x in r["collectives"])
    layout = " x ".join(f"{a}={s}" for a, s in r["mesh"].items() if s > 1)
    total = r["argument_bytes"] + r["temp_bytes"]
    weights = f"{r['trainable_param_bytes'] / GiB:.2f} / {r['frozen_param_bytes'] / GiB:.2f}"
    counts = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
    return (f"| {preset} | {label} | {n} | {layout} | {r['attention']} | "
            f"{r['argument_bytes'] / GiB:.2f} | {weights} | {r['temp_bytes'] / GiB:.2f} | "
            f"{total / GiB:.2f} | {a2a / GiB:.2f} | {every / GiB:.2f} | {counts} | "
            f"{r['compile_s']:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny presets, a smoke run")
    args = parser.parse_args()
    os.environ["JAX_PLATFORMS"] = "cpu"  # the CUDA plugin's GPUs: compile-only targets
    from ndjax.runtime.console import native_stderr

    with native_stderr():
        import jax
        jax.devices()
    from ndjax.hardware import gpu_target

    gpu_target.require()
    print(f"`PYTHONPATH=. python bench/open_models.py{' --tiny' if args.tiny else ''}`, "
          f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
          f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores, no GPU), "
          f"jax {jax.__version__}\n")
    print("Compiled for H100s (XLA's GPU compiler, no GPU), bfloat16, remat full, one row "
          "per GPU; GiB per device; weights = trained / frozen; a2a = the experts' "
          "all-to-all bytes one device sends per step, all = every collective's:\n")
    print("| model | training | GPUs | mesh | attention | arguments | weights | "
          "temporaries | total | a2a | all | collectives per step | compile s |\n"
          "|:--|:--|--:|:--|:--|--:|--:|--:|--:|--:|--:|:--|--:|")
    for case in TINY if args.tiny else CASES:
        print(row(case), flush=True)


if __name__ == "__main__":
    main()
