"""Document-aware skipping, timed on CPU: rows of short documents against the same rows
as one document.

Attention alone, forward and backward (``jax.vjp``), float32, q/k/v random, 4 query
heads over 2 kv heads of 64: the same kernel, shapes and values twice, once on rows
packed with documents of ``--doc-min`` .. ``--doc-max`` tokens (uniform) and once on
the same rows as one document each. Each is compiled and warmed up, then timed in
alternating rounds (median). Per kernel: ms per call, tokens/s, the speed-up (one
document's ms / packed ms), and the work the packed rows computed as a share of one
document's, counted as the kernel ran:

* ``blocked`` (auto's kernel from 129 to 1024 tokens on CPU): 8 query blocks, each
  against the keys of its own and the previous block or its full range
  (``picked_key_ranges``); work = score columns computed.
* ``tiled`` (auto's above 1024): the ring kernel on one shard, zigzag halves, key
  tiles of ``--kv-tile``; work = (query piece x key tile) pairs
  (``ring_attention_work``).
* ``ring`` at context 4 (zigzag) on 4 simulated CPU devices, which share this
  machine's cores: the time is the 4 shards' together; work = the busiest shard's.

    PYTHONPATH=. python bench/doc_skipping.py
    PYTHONPATH=. python bench/doc_skipping.py --tiny   # smoke run: short rows, 1 round
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ndjax.ops import attention as attn  # noqa: E402
from ndjax.ops import ring_attention as ra  # noqa: E402
from ndjax.parallel.mesh import ParallelDims, build_mesh  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64
CONTEXT = 4


def documents(rows: int, seq: int, doc_min: int, doc_max: int, seed: int = 0) -> np.ndarray:
    """Segment ids of ``rows`` rows packed with documents of doc_min..doc_max tokens."""
    rng = np.random.default_rng(seed)
    ends = np.cumsum(rng.integers(doc_min, doc_max + 1, size=(rows, seq)), axis=1)
    return np.stack([np.searchsorted(e, np.arange(seq), side="right") for e in ends]
                    ).astype(np.int32)


def inputs(rows: int, seq: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(rows, seq, HEADS, HEAD_DIM)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(rows, seq, KV_HEADS, HEAD_DIM)), jnp.float32)
            for _ in range(2))
    dout = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    return q, k, v, dout


def kernels(kv_tile: int):
    """name -> (attention(q, k, v, seg), work(q, k, v, seg) -> a number, layout or None)."""
    mesh = build_mesh(ParallelDims(fsdp=1, context=CONTEXT), jax.devices()[:CONTEXT])

    def blocked(q, k, v, seg):
        return attn.blocked(q, k, v, seg, attn.query_blocks(q.shape[1]))

    def blocked_work(q, k, v, seg):
        s = seg.shape[1]
        blocks = attn.query_blocks(s)
        picked = np.asarray(attn.picked_key_ranges(seg, blocks)).tolist()
        size = s // blocks
        return sum((i + 1) * size - starts[p]
                   for i, (starts, p) in enumerate(zip(attn.key_ranges(s, blocks), picked)))

    def ring_kernel(mesh):
        kw = dict(mesh=mesh, layout="zigzag", kv_tile=kv_tile)

        def run(q, k, v, seg):
            return ra.ring_attention(q, k, v, seg, **kw)

        @jax.jit
        def tiles(q, k, v, seg):
            return ra.ring_attention_work(q, k, v, seg, **kw)[2]

        def work(q, k, v, seg):
            return int(np.max(tiles(q, k, v, seg)))
        return run, work

    tiled, tiled_work = ring_kernel(None)
    ring, ring_work = ring_kernel(mesh)
    return {"blocked": (blocked, blocked_work, None),
            "tiled": (tiled, tiled_work, None),
            f"ring c={CONTEXT}": (ring, ring_work, "zigzag")}


def timed(fn, args, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=4096, help="tiled's and ring's rows")
    p.add_argument("--blocked-seq-len", type=int, default=1024)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--doc-min", type=int, default=16)
    p.add_argument("--doc-max", type=int, default=256)
    p.add_argument("--kv-tile", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="smoke run: 512 / 256 tokens, 1 round")
    a = p.parse_args()
    if a.tiny:
        a.seq_len, a.blocked_seq_len, a.kv_tile, a.rounds = 512, 256, 64, 1
        a.doc_min, a.doc_max = 8, 32
    print(f"## Document-aware skipping on CPU ({os.cpu_count()} cores, jax "
          f"{jax.__version__})\n")
    print(f"Forward + backward of attention alone, float32, {a.rows} row(s), {HEADS} query "
          f"heads over {KV_HEADS} kv heads of {HEAD_DIM}; packed rows: documents of "
          f"{a.doc_min}-{a.doc_max} tokens (uniform); 'one doc': the same rows as one "
          f"document. Median of {a.rounds} alternating round(s) after a warm-up; work: "
          "what the packed rows computed, as a share of one document's.\n")
    print("| kernel | tokens | row | ms | tokens/s | speed-up | work |")
    print("|:---|---:|:---|---:|---:|---:|---:|")
    for name, (attend, work, layout) in kernels(a.kv_tile).items():
        seq = a.blocked_seq_len if name == "blocked" else a.seq_len
        q, k, v, dout = inputs(a.rows, seq)
        packed = documents(a.rows, seq, a.doc_min, a.doc_max)
        rows = {"one doc": np.zeros_like(packed), "packed": packed}
        perm = ra.layout_permutation(layout, seq, CONTEXT) if layout else None
        if perm is not None:  # the ring's zigzag order, as Experiment.device_batch makes it
            q, k, v, dout = (x[:, perm] for x in (q, k, v, dout))
            rows = {r: seg[:, perm] for r, seg in rows.items()}

        @jax.jit
        def step(q, k, v, seg, dout, attend=attend):
            out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, seg), q, k, v)
            return out, vjp(dout)

        args = {r: (q, k, v, jnp.asarray(seg), dout) for r, seg in rows.items()}
        for r in rows:  # compile and warm up
            timed(step, args[r], 1)
        times = {r: [] for r in rows}
        for _ in range(a.rounds):
            for r in rows:
                times[r] += timed(step, args[r], 1)
        ms = {r: statistics.median(t) * 1e3 for r, t in times.items()}
        done = {r: work(q, k, v, jnp.asarray(seg)) for r, seg in rows.items()}
        for r in rows:
            speed = ms["one doc"] / ms[r]
            print(f"| {name} | {seq} | {r} | {ms[r]:.1f} | {a.rows * seq / ms[r] * 1e3:,.0f} "
                  f"| {speed:.2f}x | {done[r] / done['one doc']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
