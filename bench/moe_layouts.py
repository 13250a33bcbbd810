"""Mixture-of-experts layouts side by side: the expert degree's memory, exchange bytes and
roofline step time compiled for H100s, and the tiny MoE's CPU tokens/s dropless, in
capacity mode and against a dense model of its active size.

    PYTHONPATH=. python bench/moe_layouts.py           # ~20 compiles (gpu-compile extra)
    PYTHONPATH=. python bench/moe_layouts.py --tiny    # smoke run: tiny shapes, 1 round
    PYTHONPATH=. python bench/moe_layouts.py --no-gpu  # the CPU part only
    PYTHONPATH=. python bench/moe_layouts.py --no-cpu  # the GPU compiles only

GPU part: 2 layers of each real size (Qwen3-30B-A3B and Mixtral 8x7B), bfloat16,
remat full, 4096-token rows, one row per device, the experts as Mosaic grouped matmuls,
compiled by XLA's GPU compiler for N H100s (no GPU needed) with mesh.expert = 1, 2, 4,
8 and fsdp the rest, and at expert=8 in capacity mode (factor 1.25) too. Columns:
memory per device as the compile plans it; the bytes one device sends per step in
all-to-alls (the experts' ragged all-to-alls count the (token, expert) pairs a device
has, (expert - 1)/expert of which leave it under balanced routing; their buffers, in the
temporaries, are sized for the worst case) and in every collective; the roofline step
time (``ndjax.hardware.roofline``: model FLOPs plus remat's rerun at the GPU's peak, then the
collectives' bytes over NVLink or the network, not overlapped) and its tokens/s.
Estimates from compiles, not runs.

CPU part: one CPU device, the tiny MoE (8 experts, top 2) dropless and with
capacity_factor 1.25, and a dense model with the same active MLP width (ffn_dim =
2 x the experts' width), timed in alternation (``--rounds`` rounds of ``--steps``
steps, the median round), so that a busy moment slows each alike.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time

GiB = 2**30
EXPERT_DEGREES = (1, 2, 4, 8)
# (family, preset, devices, layers of the real model)
GPU_MODELS = [("qwen3_moe", "qwen3_30b_a3b", 8, 48), ("mixtral", "mixtral_8x7b", 8, 32),
              ("mixtral", "mixtral_8x7b", 64, 32)]
TINY_GPU = [("qwen3_moe", "tiny", 8, 2)]
CPU_MODEL = dict(vocab_size=4096, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32)
MOE = dict(family="qwen3_moe", n_experts=8, experts_per_token=2, moe_ffn_dim=256)
CPU_VARIANTS = [("MoE, dropless", MOE), ("MoE, capacity 1.25", {**MOE, "capacity_factor": 1.25}),
                ("dense, the MoE's active width", dict(family="qwen3", ffn_dim=512))]


def gpu_config(family: str, preset: str, n: int, expert: int, capacity: float | None,
               tiny: bool):
    from ndjax.config import default_config

    c = default_config()
    c.mesh.update(dict(fsdp=n // expert, expert=expert))
    c.model.update(dict(family=family, preset=preset, remat="full", dtype="bfloat16",
                        capacity_factor=capacity))
    if not tiny:
        c.model.update(dict(n_layers=2, moe_impl="mosaic"))
    c.train.update(dict(batch_size=n, seq_len=256 if tiny else 4096))
    c.data.source = "synthetic"
    return c


def gpu_row(case, expert: int, capacity: float | None, tiny: bool) -> str:
    from ndjax.config import Settings
    from ndjax.experiment import model_config
    from ndjax.hardware import roofline
    from ndjax.hardware.flops import flops_per_token
    from ndjax.verbs.compile import compile_for

    family, preset, n, layers = case
    c = gpu_config(family, preset, n, expert, capacity, tiny)
    r = compile_for(c, "h100", n)
    cfg = model_config(Settings.parse(c).model, platform="gpu")
    t = c.train
    tokens = t.batch_size * t.seq_len
    flops = flops_per_token(cfg, t.seq_len) * tokens
    rerun = sum(roofline.recomputed_forward_flops(cfg, t.seq_len, "full").values()) * tokens
    link = roofline.traffic(r["collectives"], 8)
    est = roofline.estimate(roofline.HARDWARE["h100"], link, flops, tokens, n, "full", rerun)
    a2a = sum(x["ring_bytes"] * x["executed"] for x in r["collectives"]
              if "all-to-all" in x["kind"])
    every = sum(x["ring_bytes"] * x["executed"] for x in r["collectives"])
    mesh = " x ".join(f"{a}={s}" for a, s in r["mesh"].items() if s > 1)
    return (f"| {preset} ({'all' if tiny else 2} of {layers} layers) | {n} | {mesh} | "
            f"{capacity or 'dropless'} | {r['argument_bytes'] / GiB:.2f} | "
            f"{r['temp_bytes'] / GiB:.2f} | {a2a / GiB:.2f} | {every / GiB:.2f} | "
            f"{est.serial_s * 1e3:,.1f} | {est.tokens_per_s():,.0f} | {r['compile_s']:.0f} |")


def gpu_part(tiny: bool) -> None:
    from ndjax.hardware import gpu_target

    gpu_target.require()
    print("Compiled for H100s (XLA's GPU compiler, no GPU), one 4096-token row per device, "
          "bfloat16, remat full, experts as Mosaic grouped matmuls; a2a = all-to-all bytes "
          "one device sends per step (the experts' exchange under balanced "
          "routing), all = every collective's; roofline = compute at peak + bytes over the "
          "links, not overlapped:\n")
    print("| model | GPUs | mesh | capacity | arguments GiB | temporaries GiB | a2a GiB | "
          "all GiB | roofline ms | tokens/s | compile s |\n"
          "|:--|--:|:--|:--|--:|--:|--:|--:|--:|--:|--:|")
    for case in TINY_GPU if tiny else GPU_MODELS:
        # The smoke run: one compile, through the exchange and capacity mode.
        for expert, capacity in ([(2, 1.25)] if tiny else
                                 [*((e, None) for e in EXPERT_DEGREES), (8, 1.25)]):
            print(gpu_row(case, expert, capacity, tiny), flush=True)
    print()


def cpu_part(rounds: int, steps: int, tiny: bool) -> None:
    import jax

    from ndjax.config import default_config
    from ndjax.data.loader import make_loader
    from ndjax.experiment import Experiment

    def build(model: dict):
        c = default_config()
        c.mesh.fsdp = 1
        c.model.update({**CPU_MODEL, **model})
        if tiny:
            c.model.update(dim=64, n_layers=2, head_dim=16, vocab_size=512)
            c.model.update({k: 64 if k in ("moe_ffn_dim",) else 128 if k == "ffn_dim" else v
                            for k, v in model.items() if k in ("moe_ffn_dim", "ffn_dim")})
        c.train.update(dict(batch_size=8, seq_len=256, lr=1e-3))
        c.data.source = "synthetic"
        exp = Experiment.from_config(c, jax.devices()[:1])
        with make_loader(c, exp.model_cfg.vocab_size, prefetch=0) as loader:
            batches = [exp.device_batch(loader.batch(i)) for i in range(steps + 1)]
        state = exp.init_state()
        state, m = exp.compiled_step(state, batches[0])  # compiled, and one step run
        jax.block_until_ready(m)
        return exp, [state], batches

    built = [(name, *build(model)) for name, model in CPU_VARIANTS]
    times: dict[str, list[float]] = {name: [] for name, *_ in built}
    dropped: dict[str, float] = {}
    for _ in range(rounds):
        for name, exp, holder, batches in built:
            state = holder[0]
            start = time.perf_counter()
            for b in batches[1:]:
                state, m = exp.compiled_step(state, b)
            jax.block_until_ready(m)
            times[name].append((time.perf_counter() - start) / steps)
            holder[0] = state
            dropped[name] = float(m.get("expert_dropped", 0.0))
    tokens = 8 * 256
    base = statistics.median(times[CPU_VARIANTS[0][0]])
    print(f"One CPU device, batch 8 x 256, {rounds} rounds of {steps} steps in alternation "
          "(median round):\n")
    print("| model | tokens/s | vs dropless | pairs dropped (last step) |\n|:--|--:|--:|--:|")
    for name, *_ in built:
        t = statistics.median(times[name])
        print(f"| {name} | {tokens / t:,.0f} | {base / t:.2f}x | {dropped[name]:.1%} |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="smoke run")
    parser.add_argument("--no-gpu", action="store_true", help="the CPU part only")
    parser.add_argument("--no-cpu", action="store_true", help="the GPU compiles only")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    os.environ["JAX_PLATFORMS"] = "cpu"
    from ndjax.runtime.console import native_stderr

    with native_stderr():
        import jax
        jax.config.update("jax_num_cpu_devices", 8)
        jax.devices()
    rounds, steps = (1, 2) if args.tiny else (args.rounds, args.steps)
    flags = "".join(f" {f}" for f, on in (("--tiny", args.tiny), ("--no-gpu", args.no_gpu),
                                          ("--no-cpu", args.no_cpu)) if on)
    print(f"`PYTHONPATH=. python bench/moe_layouts.py{flags}` on "
          f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores, no GPU), "
          f"jax {jax.__version__}, {datetime.date.today().isoformat()}\n")
    if not args.no_gpu:
        gpu_part(args.tiny)
    if not args.no_cpu:
        cpu_part(rounds, steps, args.tiny)


if __name__ == "__main__":
    main()
