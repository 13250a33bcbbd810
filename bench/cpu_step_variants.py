"""ndjax's one-device CPU step under model options, side by side, in one run.

The model, batch and optimizer of ``bench/cpu_vs_torch.py`` (issue 14's), on one CPU
device, with each group's variants alive at once in their own worker processes and
timed in alternation (``--rounds`` rounds of ``--steps`` steps; the median round), so
that a busy moment slows every variant alike. The groups are the measurements behind
ndjax's CPU defaults:

* ``layers``: the layer loop (scanned or unrolled) crossed with the attention kernel
  (dense, blocked or tiled) at 8 x 256 tokens, and the defaults (``model.scan_layers`` unset,
  ``model.attn_impl=auto``), against the defaults before issue 14 (scanned, dense);
* ``seq``: dense, blocked and tiled attention at 128 to 1024 tokens per row (2,048
  tokens per step), layers unrolled: where ``auto``'s switches belong;
* ``attention``: one layer's attention alone, forward and backward (``jax.grad``),
  at the step's shapes (8 x 256 tokens, 8 heads / 4 kv heads of 32), for ndjax's
  dense, blocked and tiled kernels and PyTorch's ``scaled_dot_product_attention``
  (``is_causal``, ``enable_gqa``), in this process, alternating.

    PYTHONPATH=. python bench/cpu_step_variants.py            # about 8 minutes on 2 cores
    PYTHONPATH=. python bench/cpu_step_variants.py --tiny     # smoke run, tiny model
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_vs_torch import MODEL, TINY_MODEL, TRAIN, Worker, cores, cpu_model, serve_experiment  # noqa: E402 -- the bench's model, batch, optimizer and worker

TOKENS = 2048  # per step, as cpu_vs_torch's 8 x 256


def groups() -> dict[str, list[tuple[str, dict]]]:
    """name -> [(variant, model and train overrides)]."""
    layers = [("scanned, dense", {"model.scan_layers": True, "model.attn_impl": "dense"}),
              ("defaults (scan_layers unset, attn_impl auto)", {})]
    layers += [(f"{loop}, {impl}", {"model.scan_layers": loop == "scanned",
                                    "model.attn_impl": impl})
               for loop in ("scanned", "unrolled") for impl in ("dense", "blocked", "tiled")
               if (loop, impl) != ("scanned", "dense")]
    seqs = (128, 256, 512, 1024)
    seq = [(f"seq {s}, {impl}", {"model.scan_layers": False, "model.attn_impl": impl,
                                 "train.seq_len": s, "train.batch_size": TOKENS // s})
           for s in seqs for impl in ("dense", "blocked", "tiled")]
    return {"layers": layers, "seq": seq, "attention": []}


def attention_alone(rounds: int, reps: int = 20) -> list[tuple[str, list[float]]]:
    """ms per forward + backward of one layer's attention, per round."""
    import ndjax  # noqa: F401 -- first: sets up the allocator before jax starts threads
    # isort: split
    import jax
    import numpy as np
    import torch
    import torch.nn.functional as F

    from ndjax.ops import attention

    b, s, h, kv, d = 8, 256, MODEL["n_heads"], MODEL["n_kv_heads"], MODEL["dim"] // MODEL["n_heads"]
    rng = np.random.default_rng(0)
    q, k, v = (jax.numpy.asarray(rng.standard_normal((b, s, n, d), np.float32))
               for n in (h, kv, kv))
    seg = jax.numpy.ones((b, s), jax.numpy.int32)
    cfg = type("Cfg", (), dict(attn_kv_tile=512))

    def jax_case(name):
        kernel = attention.KERNELS[name]
        grad = jax.jit(jax.grad(lambda q, k, v: (kernel(q, k, v, seg, cfg) ** 2).sum(),
                                argnums=(0, 1, 2)))
        return lambda: jax.block_until_ready(grad(q, k, v))

    torch.set_num_threads(cores())
    tq, tk, tv = (torch.randn(b, n, s, d, requires_grad=True) for n in (h, kv, kv))

    def torch_case():
        out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True)
        (out ** 2).sum().backward()

    cases = [("ndjax dense", jax_case("dense")), ("ndjax blocked", jax_case("blocked")),
             ("ndjax tiled", jax_case("tiled")), ("PyTorch sdpa", torch_case)]
    times = {name: [] for name, _ in cases}
    for _, fn in cases:
        for _ in range(3):
            fn()
    for _ in range(rounds):
        for name, fn in cases:
            # PyTorch's OpenMP threads spin for a while after their last parallel
            # region; let them go idle so that they do not slow the next case.
            time.sleep(0.5)
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            times[name].append(1000 * (time.perf_counter() - start) / reps)
    return list(times.items())


def worker(args) -> None:
    import ndjax  # noqa: F401 -- first: sets up the allocator before jax starts threads
    # isort: split
    import jax

    from ndjax.config import default_config
    from ndjax.experiment import Experiment

    c = default_config()
    c.model.update(json.loads(args.model))
    c.train.update(dict(batch_size=TOKENS // 256, seq_len=256, schedule="constant",
                        warmup_steps=0, steps=10**6, **TRAIN))
    c.data.source = "synthetic"
    for key, value in json.loads(args.overrides).items():
        section, field = key.split(".")
        c[section][field] = value
    serve_experiment(Experiment.from_config(c, jax.devices()[:1]), args.warmup)


@dataclasses.dataclass
class Variant:
    name: str
    worker: Worker
    ms: list[float] = dataclasses.field(default_factory=list)

    @property
    def info(self) -> dict:
        return self.worker.info

    def time(self, steps: int) -> None:
        self.ms.append(1000 * self.worker.time(steps)["seconds"] / steps)


def start(name: str, overrides: dict, args) -> Variant:
    worker = Worker(["--worker", "--model", json.dumps(args.model_dims),
                     "--overrides", json.dumps(overrides), "--warmup", str(args.warmup)],
                    script=__file__)
    worker.wait_ready()
    if worker.error:
        worker.close()
        raise RuntimeError(f"{name}: {worker.error}")
    return Variant(name, worker)


def run_group(variants: list[tuple[str, dict]], args) -> list[Variant]:
    # Started one at a time (compiling in parallel would only slow each other), then
    # all alive while the timed rounds alternate.
    started = []
    try:
        for name, overrides in variants:
            started.append(start(name, overrides, args))
        for _ in range(args.rounds):
            for v in started:
                v.time(args.steps)
    finally:
        for v in started:
            v.worker.close()
    return started


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after compiling")
    p.add_argument("--groups", default="layers,seq,attention",
                   help="comma-separated: layers, seq, attention")
    p.add_argument("--tiny", action="store_true",
                   help="smoke run: tiny model, 2 of the layers group, 1 round")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--overrides", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.tiny:  # the defaults' path and each explicit choice, at the bench's seq of 256
        args.rounds, args.steps, args.warmup, args.groups = 1, 1, 1, "layers"
    args.model_dims = TINY_MODEL if args.tiny else MODEL
    table = groups()
    if args.tiny:  # the first row (what the others are compared with) and the defaults
        table["layers"] = [(name, o) for name, o in table["layers"] if name in (
            "scanned, dense", "defaults (scan_layers unset, attn_impl auto)")]
    chosen = [g.strip() for g in args.groups.split(",") if g.strip()]
    unknown = [g for g in chosen if g not in table]
    if unknown:
        p.error(f"unknown groups {unknown}; choose from {list(table)}")

    import jax

    load = os.getloadavg()[0]
    print(f"# ndjax CPU step variants, {datetime.datetime.now():%Y-%m-%d %H:%M}, {cpu_model()}, "
          f"{cores()} cores; jax {jax.__version__}")
    print(f"model {args.model_dims}, float32, {TOKENS} tokens per step, one device; "
          f"{args.rounds} rounds x {args.steps} steps after {args.warmup} warm-up steps, "
          "variants alternating; ms/step = median round\n")
    alone = attention_alone(args.rounds) if "attention" in chosen else []
    # Alive together: the layers group; in the seq group, the kernels of one length
    # (a dozen workers at once, each keeping its peak memory, slowed one another).
    results = {}
    for g in chosen:
        if g == "layers":
            results[g] = run_group(table[g], args)
        elif g == "seq":
            results[g] = [v for i in range(0, len(table[g]), 3)
                          for v in run_group(table[g][i:i + 3], args)]
    print(f"load average (1 min) at start {load:.1f}, at end {os.getloadavg()[0]:.1f} on "
          f"{cores()} cores\n")
    for g, variants in results.items():
        # speed-up over the group's first variant; in the seq group, over dense at that seq
        against = "the first row" if g == "layers" else "dense at the same seq"
        print(f"| {g}: variant | layers | attention | compile s | ms/step | rounds | "
              f"speed-up over {against} |")
        print("|---|---|---|--:|--:|---|--:|")
        for i, v in enumerate(variants):
            base = statistics.median(variants[0 if g == "layers" else i - i % 3].ms)
            ms = statistics.median(v.ms)
            print(f"| {v.name} | {'scanned' if v.info['scan_layers'] else 'unrolled'} | "
                  f"{v.info['attention']} | {v.info['compile_s']:.1f} | {ms:.0f} | "
                  f"{', '.join(f'{x:.0f}' for x in v.ms)} | {base / ms:.2f}x |")
        print()
    if alone:
        base = statistics.median(alone[-1][1])
        print("| attention alone (one layer, forward + backward) | ms | rounds | vs PyTorch |")
        print("|---|--:|---|--:|")
        for name, ms in alone:
            print(f"| {name} | {statistics.median(ms):.1f} | {', '.join(f'{x:.1f}' for x in ms)} "
                  f"| {statistics.median(ms) / base:.2f}x the time |")
        print()


if __name__ == "__main__":
    main()
