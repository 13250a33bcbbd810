"""Each model family's real-size preset, compiled by XLA's GPU compiler for 8 H100s
(``ndjax compile``'s figures), and a sliding window's memory at 32k tokens
next to the same model attending globally.

    PYTHONPATH=. python bench/families.py           # ~10 compiles, a few minutes on 2 cores
    PYTHONPATH=. python bench/families.py --tiny    # the tiny presets, a smoke run
    PYTHONPATH=. python bench/families.py --moe     # the MoE families' grouped matmuls

Every row: fsdp=4 x tensor=2 (``configs/<family>_fsdp_tp.py``), bfloat16, the
attention kernel ``auto`` picks on the GPU. Memory per device: arguments (the
sharded parameters, optimizer state and batch) and temporaries (activations and
everything else the step allocates), as the compile plans them (no cuBLAS/cuDNN
workspaces: docs/compile-and-plan.md, "Compiling for GPUs you don't have"); and the
step's model FLOPs (``ndjax.hardware.flops``: a local layer counts the keys in its window),
which is where a window saves with a flash kernel, whose memory is linear in the
sequence with or without one.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform

GiB = 2**30

# (family, preset, batch, seq, remat, extra model fields, label)
FAMILY_CASES = [
    ("llama", "llama3_8b", 8, 4096, "full", {}, ""),
    ("mistral", "mistral_7b_v0_1", 8, 4096, "full", {}, "window 4096 (= seq: no effect)"),
    ("qwen2", "qwen2_5_7b", 8, 4096, "full", {}, ""),
    ("qwen3", "qwen3_8b", 8, 4096, "full", {}, ""),
    ("gemma3", "gemma3_12b", 8, 4096, "full", {}, "5 local (window 1024) : 1 global"),
]
# A window's memory at 32k tokens: the preset, and the same model with every layer global.
WINDOW_CASES = [
    ("mistral", "mistral_7b_v0_1", 4, 32768, "full", {}, "window 4096"),
    ("mistral", "mistral_7b_v0_1", 4, 32768, "full", {"sliding_window": 0}, "global"),
    ("gemma3", "gemma3_12b", 4, 32768, "full", {}, "5 local (window 1024) : 1 global"),
    ("gemma3", "gemma3_12b", 4, 32768, "full", {"sliding_window": 0}, "global"),
]
# The MoE families' experts as jax's Mosaic GPU grouped matmuls and as ragged_dot (a
# dense matmul over every expert on GPUs), 2 layers of each real size.
MOE_CASES = [
    (family, preset, 8, 4096, "full", {"n_layers": 2, "moe_impl": impl},
     f"2 of {layers}; experts {impl}")
    for family, preset, layers in (("qwen3_moe", "qwen3_30b_a3b", 48),
                                   ("mixtral", "mixtral_8x7b", 32),
                                   ("qwen2_moe", "qwen2_57b_a14b", 28))
    for impl in ("mosaic", "xla")]
# Two families, the plainest and the one with local and global layers: the script's
# every path in CI's smoke run (tests/test_gpu_compile.py) at two compiles, not five.
TINY = [(family, "tiny", 8, 256, "full", {}, "") for family in ("llama", "gemma3")]


def row(case, hardware: str) -> str:
    from ndjax.config import Settings, default_config
    from ndjax.experiment import model_config
    from ndjax.hardware.flops import flops_per_token
    from ndjax.verbs.compile import compile_for

    family, preset, batch, seq, remat, extra, label = case
    c = default_config()
    c.mesh.update(dict(fsdp=4, tensor=2))
    c.model.update(dict(family=family, preset=preset, remat=remat, **extra))
    c.train.update(dict(batch_size=batch, seq_len=seq))
    c.data.source = "synthetic"
    r = compile_for(c, hardware, 8)
    total = r["argument_bytes"] + r["temp_bytes"]
    cfg = model_config(Settings.parse(c).model, platform="gpu")
    tflops = flops_per_token(cfg, seq) * batch * seq / 1e12
    return (f"| {family} | {preset} | {label or '-'} | {batch} x {seq} | {remat} | "
            f"{r['attention']} | {r['argument_bytes'] / GiB:.1f} | {r['temp_bytes'] / GiB:.1f} | "
            f"{total / GiB:.1f} | {tflops:,.0f} | {r['compile_s']:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny presets, a smoke run")
    parser.add_argument("--moe", action="store_true",
                        help="only the MoE families, their experts' two implementations")
    parser.add_argument("--hardware", default="h100")
    args = parser.parse_args()
    os.environ["JAX_PLATFORMS"] = "cpu"
    from ndjax.runtime.console import native_stderr

    with native_stderr():
        import jax
        jax.config.update("jax_num_cpu_devices", 8)
        jax.devices()
    from ndjax.hardware import gpu_target, roofline

    gpu_target.require()
    flag = " --tiny" if args.tiny else " --moe" if args.moe else ""
    print(f"`PYTHONPATH=. python bench/families.py{flag}` on "
          f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores, no GPU), "
          f"jax {jax.__version__}, {datetime.date.today().isoformat()}; compiled for 8 x "
          f"{roofline.HARDWARE[args.hardware].name}, fsdp=4 x tensor=2, bfloat16")
    print()
    header = ("| family | preset | layers | batch x seq | remat | attention | arguments GiB | "
              "temporaries GiB | total GiB | model TFLOP per step | compile s |\n"
              "|:--|:--|:--|--:|:--|:--|--:|--:|--:|--:|--:|")
    groups = [("", TINY)] if args.tiny else [
        ("The MoE families' grouped matmuls", MOE_CASES)] if args.moe else [
        ("Each family's real size", FAMILY_CASES),
        ("A sliding window at 32k tokens", WINDOW_CASES)]
    for title, cases in groups:
        if title:
            print(f"{title}:\n")
        print(header)
        for case in cases:
            print(row(case, args.hardware), flush=True)
        print()


if __name__ == "__main__":
    main()
