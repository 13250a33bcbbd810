"""Context parallelism: memory per device, causal work balance, collective-permutes.

Three measurements on simulated CPU devices, none of them timed:

1. Per-device temp memory of the compiled train step
   (``memory_analysis().temp_size_in_bytes``) at a long sequence, batch 1, tiny
   model, for context 1, 2, 4, 8 (mesh context=c over c devices). Context 1
   runs the same tiled kernel on one shard (``model.attn_impl=ring``); dense
   attention at context 1 is shown for contrast. Claim: falls roughly as 1/c.
2. Blocks each context shard computes under the causal mask, counted by the
   kernel as it runs (``ring_attention_blocks``), zigzag vs contiguous, in units
   of one (S/2c x S/2c) block. Claim: zigzag equal across shards (within one
   block), contiguous growing with the shard index. 2b: the same (zigzag) with
   document-aware skipping on a packed row of short documents, against one long
   document: blocks and tile pairs per shard, and how balanced they stay.
3. Collective-permutes executed per train step, from the compiled HLO (each
   while loop's count times its known trip count), against the design's
   n_layers x (forward 3(c-1) + backward 2(c-1) + c), split into keys/values
   and their gradients (float) and segment ids (int; the same in every layer,
   so XLA may hoist or share their sends).

Run from the repo root:

    PYTHONPATH=. python bench/context_parallel.py --seq-len 16384
    PYTHONPATH=. python bench/context_parallel.py --tiny   # smoke run: context 1, 2; 256 tokens
"""

from __future__ import annotations

import argparse
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ndjax.config import default_config  # noqa: E402
from ndjax.experiment import Experiment  # noqa: E402
from ndjax.ops import ring_attention as ra  # noqa: E402
from ndjax.parallel.collectives import collectives  # noqa: E402
from ndjax.parallel.mesh import ParallelDims, build_mesh  # noqa: E402

MODEL = dict(vocab_size=256, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=128)
CONTEXTS = (1, 2, 4, 8)


def experiment(context: int, seq_len: int, impl: str, layout: str = "zigzag") -> Experiment:
    c = default_config()
    c.model.update(dict(MODEL, attn_impl=impl, cp_layout=layout))
    c.mesh.update(dict(replica=1, fsdp=1, context=context, tensor=1))
    c.train.update(dict(batch_size=1, seq_len=seq_len))
    # Only compiled, never fed: the synthetic source fits vocab 256 (the byte
    # tokenizer needs 259), so the model stays the one BENCHMARKS.md measured.
    c.data.source = "synthetic"
    return Experiment.from_config(c, jax.devices()[:context])


# ----- HLO: collective-permutes executed per step ------------------------------------------

def executed_collective_permutes(hlo: str) -> dict[str, tuple[int, int]]:
    """Collective-permutes of float (keys, values, their gradients) and integer
    (segment ids) arrays: (static count in the text, count executed per step),
    from ``ndjax.parallel.collectives`` (while loops times their known trip counts)."""
    out = {"float": [0, 0], "int": [0, 0]}
    for c in collectives(hlo):
        if c.kind == "collective-permute":
            counts = out["int" if c.dtype.rstrip("0123456789") == "s" else "float"]
            counts[0] += 1
            counts[1] += c.executed
    return {kind: (static, run) for kind, (static, run) in out.items()}


# ----- the three measurements --------------------------------------------------------------


def memory_and_permutes(seq_len: int, contexts: tuple[int, ...] = CONTEXTS) -> None:
    print(f"### 1+3. Train step at {seq_len} tokens, batch 1: temp memory and "
          "collective-permutes\n")
    print("Permutes: K/V/dK/dV (float) and segment ids (int), executed per step (in the HLO "
          "text); predicted from the design, n_layers x per call.\n")
    print("| context | attention | layout | temp MiB/device | / context-1 ring | ideal 1/c "
          "| K/V permutes | predicted | segment-id permutes | predicted at most | compile s |")
    print("|---:|:---|:---|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = None
    rows = [(1, "dense", "-")] + [(c, "ring", "zigzag") for c in contexts] + \
        [(contexts[-1], "ring", "contiguous")]
    n_layers = MODEL["n_layers"]
    for context, impl, layout in rows:
        exp = experiment(context, seq_len, impl, "zigzag" if layout == "-" else layout)
        t0 = time.perf_counter()
        compiled = exp.compiled_step
        seconds = time.perf_counter() - t0
        temp = compiled.memory_analysis().temp_size_in_bytes
        counts = executed_collective_permutes(compiled.as_text())
        hops = context - 1
        # Forward: K and V, c-1 hops each; backward: stacked K/V c-1 hops, stacked
        # dK/dV c hops. Segment ids: c-1 hops in each direction, at most.
        kv = n_layers * (2 * hops + hops + (context if context > 1 else 0))
        segs = n_layers * 2 * hops
        if impl == "ring" and context == 1:
            base = temp
        ratio = f"{temp / base:.3f}" if base and impl == "ring" else "-"
        ideal = f"{1 / context:.3f}" if impl == "ring" else "-"
        (kv_static, kv_run), (seg_static, seg_run) = counts["float"], counts["int"]
        print(f"| {context} | {impl} | {layout} | {temp / 2**20:.1f} | {ratio} | {ideal} | "
              f"{kv_run} ({kv_static} in text) | {kv} | {seg_run} ({seg_static} in text) | "
              f"{segs} | {seconds:.1f} |", flush=True)
    print()


def work_balance(seq_len: int, contexts: tuple[int, ...] = CONTEXTS) -> None:
    print(f"### 2. Blocks computed per context shard under the causal mask ({seq_len} tokens)\n")
    print("Unit: one (S/2c x S/2c) block; a contiguous block (S/c x S/c) counts 4. "
          "Needed in all: c(2c+1) (the blocks on or below the diagonal).\n")
    print("| context | layout | blocks per shard | max - min | total | needed |")
    print("|---:|:---|:---|---:|---:|---:|")
    rng = np.random.default_rng(0)
    b, h, kv, d = 1, 4, 2, 8
    q = jnp.asarray(rng.normal(size=(b, seq_len, h, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, seq_len, kv, d)), jnp.float32)
    seg = jnp.zeros((b, seq_len), jnp.int32)
    for context in contexts:
        mesh = build_mesh(ParallelDims(fsdp=1, context=context), jax.devices()[:context]) \
            if context > 1 else None
        for layout in ra.LAYOUTS:
            unit = 4 // ra.PIECES[layout] ** 2  # contiguous pieces are twice as long
            run = jax.jit(lambda q, k, seg, layout=layout, mesh=mesh: ra.ring_attention_blocks(
                q, k, k, seg, mesh=mesh, layout=layout, kv_tile=128)[1])
            blocks = [int(x) * unit for x in np.asarray(run(q, k, seg))]
            print(f"| {context} | {layout} | {blocks} | {max(blocks) - min(blocks)} | "
                  f"{sum(blocks)} | {context * (2 * context + 1)} |", flush=True)
    print()


def packed_rows(seq_len: int, contexts: tuple[int, ...] = CONTEXTS, doc_min: int = 16,
                doc_max: int = 256) -> None:
    """Document-aware skipping: blocks and tile pairs each shard computes (zigzag) on one
    long document and on a packed row of documents of doc_min..doc_max tokens."""
    print(f"### 2b. Packed rows: work per context shard, zigzag, {seq_len} tokens\n")
    rng = np.random.default_rng(0)
    ends = np.cumsum(rng.integers(doc_min, doc_max + 1, size=seq_len))
    docs = np.searchsorted(ends, np.arange(seq_len), side="right").astype(np.int32)[None]
    print(f"Packed: {int(docs.max()) + 1} documents of {doc_min}-{doc_max} tokens (uniform) in "
          "one row. Blocks and (query x key) tile pairs of 128 tokens computed by each "
          "shard, counted as the kernel runs; 'one doc' is the same row as one document.\n")
    print("| context | row | blocks per shard | total | tile pairs per shard | total | "
          "max / mean |")
    print("|---:|:---|:---|---:|:---|---:|---:|")
    b, h, kv, d = 1, 4, 2, 8
    q = jnp.asarray(rng.normal(size=(b, seq_len, h, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, seq_len, kv, d)), jnp.float32)
    for context in contexts:
        mesh = build_mesh(ParallelDims(fsdp=1, context=context), jax.devices()[:context]) \
            if context > 1 else None
        perm = ra.layout_permutation("zigzag", seq_len, context)
        run = jax.jit(lambda q, k, seg, mesh=mesh: ra.ring_attention_work(
            q, k, k, seg, mesh=mesh, layout="zigzag", kv_tile=128)[1:])
        for name, seg in (("one doc", np.zeros_like(docs)), ("packed", docs)):
            blocks, tiles = (np.asarray(x).tolist() for x in run(q[:, perm], k[:, perm],
                                                                   jnp.asarray(seg[:, perm])))
            balance = max(tiles) / (sum(tiles) / len(tiles))
            print(f"| {context} | {name} | {blocks} | {sum(blocks)} | {tiles} | {sum(tiles)} | "
                  f"{balance:.2f} |", flush=True)
    print()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--balance-seq-len", type=int, default=1024)
    p.add_argument("--packed-seq-len", type=int, default=8192)
    p.add_argument("--tiny", action="store_true",
                   help="smoke run: contexts 1 and 2 at 256 / 64 tokens (seconds, not minutes)")
    a = p.parse_args()
    contexts = CONTEXTS
    if a.tiny:
        # Every row kind (dense, ring, contiguous) and one real ring (context 2), at
        # sizes that compile in seconds; the figures mean nothing at this size.
        a.seq_len, a.balance_seq_len, contexts = 256, 64, (1, 2)
    print(f"jax {jax.__version__}, {jax.device_count()} simulated {jax.default_backend()} "
          f"devices; model {MODEL}; kv tile 512\n")
    memory_and_permutes(a.seq_len, contexts)
    work_balance(a.balance_seq_len, contexts)
    if a.tiny:
        packed_rows(1024, contexts, doc_min=16, doc_max=64)
    else:
        packed_rows(a.packed_seq_len, contexts)


if __name__ == "__main__":
    sys.exit(main())
