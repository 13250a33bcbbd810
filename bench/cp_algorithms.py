"""Context parallelism's two algorithms side by side: ring vs all-to-all on CPU.

The same model, batch and mesh (fsdp=2 x context=4 on 8 simulated CPU devices),
one process per algorithm, compiled and warmed up first, then timed in
alternating rounds: ``model.cp_impl=ring`` (key/value blocks around the context
axis, tiled) and ``model.cp_impl=all_to_all`` (sequence shards to head shards,
the one-shard kernel ``auto`` picks for the whole sequence, back). For each: the
median ms per step, tokens/s, the ratio to ring, the bytes each device sends per
step by collective kind (``ndjax.parallel.collectives``: ring bytes times executions, from
the compiled HLO) and the step's temp memory per device.

    PYTHONPATH=. python bench/cp_algorithms.py
    PYTHONPATH=. python bench/cp_algorithms.py --tiny   # smoke run: tiny model, 1 round
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_vs_torch import MODEL, TINY_MODEL, TRAIN, Worker, cores, cpu_model, serve_experiment  # noqa: E402 -- the bench's model, optimizer and worker

MESH = dict(fsdp=2, context=4)
DEVICES = 8
ALGORITHMS = ("ring", "all_to_all")


def worker(args) -> None:
    import ndjax  # noqa: F401 -- first: sets up the allocator before jax starts threads
    # isort: split
    import jax

    jax.config.update("jax_num_cpu_devices", DEVICES)

    from ndjax.config import default_config
    from ndjax.experiment import Experiment
    from ndjax.parallel.collectives import collectives

    c = default_config()
    c.model.update(dict(json.loads(args.model), cp_impl=args.cp))
    c.mesh.update(dict(dict(replica=1, fsdp=1, context=1, tensor=1), **MESH))
    c.train.update(dict(batch_size=args.batch, seq_len=args.seq, schedule="constant",
                        warmup_steps=0, steps=10**6, **TRAIN))
    c.data.source = "synthetic"
    exp = Experiment.from_config(c, jax.devices()[:DEVICES])
    compiled = exp.compiled_step
    sent: dict[str, float] = {}
    for op in collectives(compiled.as_text()):
        sent[op.kind] = sent.get(op.kind, 0.0) + op.ring_bytes * op.executed
    extra = dict(label=exp.attention.label, sent=sent,
                 temp=compiled.memory_analysis().temp_size_in_bytes)
    serve_experiment(exp, args.warmup, extra)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling")
    p.add_argument("--tiny", action="store_true", help="smoke run: tiny model, 1 round")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cp", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.tiny:
        args.seq, args.rounds, args.steps, args.warmup = 256, 1, 1, 1
    model = TINY_MODEL if args.tiny else MODEL

    import jax

    now = f"{datetime.datetime.now():%Y-%m-%d %H:%M}"
    print(f"# ndjax context parallelism, ring vs all-to-all, {now}, {cpu_model()}, "
          f"{cores()} cores; jax {jax.__version__}")
    print(f"model {model}, float32, mesh {MESH} on {DEVICES} CPU devices, batch {args.batch} x "
          f"{args.seq} tokens; {args.rounds} rounds x {args.steps} steps after {args.warmup} "
          "warm-up steps, alternating; ms/step = median round\n")
    workers = {}
    try:
        for cp in ALGORITHMS:  # one at a time: compiling side by side slows both
            w = Worker(["--worker", "--cp", cp, "--model", json.dumps(model), "--seq",
                        str(args.seq), "--batch", str(args.batch), "--warmup", str(args.warmup)],
                       script=__file__)
            workers[cp] = w
            w.wait_ready()
            if w.error:
                raise RuntimeError(f"{cp}: {w.error}")
        ms = {cp: [] for cp in workers}
        for _ in range(args.rounds):
            for cp, w in workers.items():
                ms[cp].append(1000 * w.time(args.steps)["seconds"] / args.steps)
    finally:
        for w in workers.values():
            w.close()
    tokens = args.batch * args.seq
    median = {cp: statistics.median(v) for cp, v in ms.items()}
    kinds = sorted({k for w in workers.values() for k in w.info["sent"]})
    print("| cp_impl | attention | ms/step | tokens/s | vs ring | "
          + " | ".join(f"{k} MiB" for k in kinds) + " | temp MiB |")
    print("|:--|:--|--:|--:|--:|" + "--:|" * len(kinds) + "--:|")
    for cp, w in workers.items():
        sent = " | ".join(f"{w.info['sent'].get(k, 0) / 2**20:.2f}" for k in kinds)
        print(f"| {cp} | {w.info['label']} | {median[cp]:.1f} | {tokens / median[cp] * 1000:,.0f} "
              f"| {median['ring'] / median[cp]:.2f}x | {sent} | {w.info['temp'] / 2**20:.1f} |")


if __name__ == "__main__":
    main()
