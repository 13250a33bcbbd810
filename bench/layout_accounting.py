"""Layout accounting: parameter + optimizer bytes per device against the ideal, and
every collective of the train step against the textbook volume of its layout.

Each row compiles the real train step ahead of time on simulated CPU devices
(nothing is allocated or run) for one layout: DP (replica=8), FSDP (fsdp=8), TP
(tensor=8), HSDP (replica=2 x fsdp=4), FSDP x TP (fsdp=4 x tensor=2), FSDP x CP
(fsdp=4 x context=2) and 4D (replica=2 x fsdp=2 x context=2 x tensor=2, 16
devices), at the ``tiny`` preset (batch 8 x 2048) and at ``llama3_8b`` (batch 8 x
4096), bfloat16 compute, float32 parameters and moments, remat=full, rules
``default``; attention ``tiled`` on one context shard, ``ring`` (zigzag) with
context.

Memory. Per device: the sum over the state's leaves (``exp.abstract_state``) of
the shard's size (``sharding.shard_shape``) x itemsize, cross-checked against
``compiled.memory_analysis().argument_size_in_bytes`` minus the batch's shard.
Ideal: total bytes / N, N = the product of the mesh axes that any parameter's
storage sharding uses (fsdp x context x tensor under ``default``; replica never
shards: DP's N is 1, HSDP's is 4, 4D's is 8). What stays above the ideal is
listed by cause: leaves replicated on all N devices (norm scales, step counts),
kv weights replicated over tensor when tensor > n_kv_heads, and the rest.

Communication. ``ndjax.parallel.collectives`` lists every collective with its result bytes
per device and executions per step (layer-scan trips included); each is keyed
by (kind, mesh axes), the axes read from its first group against
``exp.mesh.devices``. Two CPU habits are undone: the CPU compiler widens bfloat16
collectives to float32 (its operand is a convert from bf16), so "bytes" here
counts such operands at 2 bytes an element, as a GPU compile moves them (the
CPU-HLO figure is printed too); and its all-reduce + dynamic-slice is a
reduce-scatter (``ndjax.parallel.collectives``). Bookkeeping is listed apart: integer
collectives (segment ids), and all-reduces no bigger than 2 float32 per local
token of one loss chunk that run fewer times than there are layers (loss sums, token
count, grad norm, the vocab-parallel loss's max / sum / target logit; a small
all-reduce inside the layer scan is a norm scale's gradient and is counted).

Textbook, in result bytes per device per step (the ``Collective.bytes``
convention: gathered array, scattered shard, whole all-reduced array, received
block). D = the data axes with size > 1 (replica, fsdp, context). b, s = rows
and sequence per device (batch over replica x fsdp, sequence over context),
L = layers, "shard" = a parameter's storage shard, "compute shard" = the same
without its data axes (still split over tensor).

* all-gather over the data axes that shard a parameter (fsdp, context): its
  compute shard in the gather dtype (bf16: ndjax casts before it gathers),
  twice per step for layer weights (forward, and the backward pass's recompute
  under remat=full, whose weights the backward matmuls reuse: FSDP's "gather in
  forward and again in backward"), once for the embedding (its gradient is a
  scatter-add that reads no weights) and once for the LM head (used last in the
  forward and first in the backward; FSDP implementations keep it, e.g.
  PyTorch's root module is not resharded after forward).
* reduce-scatter over those axes: each such parameter's float32 gradient shard,
  once.
* all-reduce over the data axes that do not shard a parameter (replica; every
  data axis for a parameter stored replicated such as a norm scale): its
  float32 gradient shard, once (DP: one all-reduce of all gradients).
* all-reduce over tensor (Megatron): (b x s x dim) activations in bf16, per
  layer 2 forward (attention and MLP outputs) + 2 backward (the inputs'
  gradients of the column-parallel q/k/v and gate/up) + 1 recompute (remat=full
  recomputes the attention output, which the MLP's backward needs; the MLP
  output feeds only the next layer and is not recomputed): 5 L; plus 1 for the
  vocab-parallel embedding lookup and 1 for the LM head's input gradient.
  When tensor > n_kv_heads (kv weights stored replicated, ``Rules.kv_repeat`` =
  r), the k/v gradients are summed over the r shards that share a head
  (all-reduce of one head's slice) and gathered over the distinct heads
  (all-gather of the whole float32 gradient), per layer.
* collective-permute over context (ring attention, zigzag): one K block is
  b x s x kv_heads/tensor x head_dim in bf16; per layer 2(c-1) blocks forward
  (K and V), 2(c-1) again in the backward's recompute (remat=full reruns the
  forward ring), and backward (c-1) hops of stacked K/V plus c hops of stacked
  dK/dV (the gradients travel home), 2 blocks each: L x (6(c-1) + 2c) blocks.
  Segment ids are bookkeeping.

    PYTHONPATH=. python bench/layout_accounting.py            # tiny and llama3_8b
    PYTHONPATH=. python bench/layout_accounting.py --tiny     # smoke: 2 layers, 2 layouts
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import platform
import time

import jax

jax.config.update("jax_num_cpu_devices", 16)

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from ndjax.config import default_config  # noqa: E402
from ndjax.experiment import Experiment  # noqa: E402
from ndjax.parallel import collectives as coll  # noqa: E402

MiB = 2**20
LAYOUTS = {
    "DP": dict(replica=8),
    "FSDP": dict(fsdp=8),
    "TP": dict(tensor=8),
    "HSDP": dict(replica=2, fsdp=4),
    "FSDP x TP": dict(fsdp=4, tensor=2),
    "FSDP x CP": dict(fsdp=4, context=2),
    "4D": dict(replica=2, fsdp=2, context=2, tensor=2),
}
SHAPES = {
    "tiny": (dict(preset="tiny"), dict(batch_size=8, seq_len=2048)),
    "llama3_8b": (dict(preset="llama3_8b"), dict(batch_size=8, seq_len=4096)),
}
SMOKE = {"smoke": (dict(preset="tiny", n_layers=2, vocab_size=512),
                   dict(batch_size=8, seq_len=256))}


def experiment(model: dict, train: dict, mesh: dict) -> Experiment:
    c = default_config()
    impl = "ring" if mesh.get("context", 1) > 1 else "tiled"
    c.model.update(dict(model, dtype="bfloat16", remat="full", attn_impl=impl))
    c.mesh.update(dict(dict(replica=1, fsdp=1, context=1, tensor=1), **mesh))
    c.train.update(train)
    c.data.source = "synthetic"
    return Experiment.from_config(c, jax.devices()[:math.prod(mesh.values())])


# ----- memory ------------------------------------------------------------------------------


def _leaves(tree):
    return jax.tree_util.tree_flatten_with_path(tree)[0]


def _shard_bytes(s) -> int:
    return math.prod(s.sharding.shard_shape(s.shape)) * s.dtype.itemsize


def _sharding_axes(exp: Experiment) -> tuple[str, ...]:
    used = set()
    for _, s in _leaves(exp.abstract_state.params):
        for axes in s.sharding.spec:
            used.update((axes,) if isinstance(axes, str) else axes or ())
    return tuple(a for a in exp.mesh.axis_names if a in used and exp.mesh.shape[a] > 1)


def memory(exp: Experiment, compiled) -> dict:
    state = exp.abstract_state
    axes = _sharding_axes(exp)
    n = math.prod(exp.mesh.shape[a] for a in axes)
    leaves = _leaves(state.params) + _leaves(state.opt_state) + _leaves(state.step)
    total = sum(math.prod(s.shape) * s.dtype.itemsize for _, s in leaves)
    per_device = sum(_shard_bytes(s) for _, s in leaves)
    causes: dict[str, int] = {}
    kv_repeat = exp.rules.kv_repeat(exp.model_cfg.n_kv_heads)
    for path, s in leaves:
        excess = _shard_bytes(s) - math.prod(s.shape) * s.dtype.itemsize / n
        if excess <= 0.5:
            continue
        name = jax.tree_util.keystr(path)
        if kv_repeat > 1 and any(k in name for k in ("'wk'", "'wv'")):
            cause = f"kv weights replicated over tensor (kv_repeat={kv_repeat})"
        elif math.prod(s.sharding.shard_shape(s.shape)) == math.prod(s.shape):
            cause = "replicated (norm scales, counts)"
        else:
            cause = "other"
        causes[cause] = causes.get(cause, 0) + round(excess)
    batch = sum(_shard_bytes(s) for s in exp.abstract_batch.values())
    args = compiled.memory_analysis().argument_size_in_bytes
    return dict(axes=axes, n=n, total=total, per_device=per_device, ideal=total / n,
                args_minus_batch=args - batch, causes=causes)


# ----- collectives: source dtype, axes, keys -----------------------------------------------


def group_axes(exp: Experiment, group: tuple[int, ...]) -> tuple[str, ...]:
    coords = {d.id: idx for idx, d in np.ndenumerate(exp.mesh.devices)}
    cs = np.array([coords[i] for i in group])
    return tuple(a for k, a in enumerate(exp.mesh.axis_names) if len(set(cs[:, k])) > 1)


@dataclasses.dataclass
class Row:
    hlo: float = 0.0      # result bytes per step as the CPU HLO has them
    bytes: float = 0.0    # at the source dtype (what a GPU moves)
    ring: float = 0.0     # ring bytes sent per device per step, at the source dtype
    textbook: float = 0.0
    ring_textbook: float = 0.0


def _ring(kind: str, g: int, nbytes: float) -> float:
    c = coll.Collective(kind, "", 1, g, ((0,) * g,), 1)
    return c.ring_bytes * nbytes


def measured(exp: Experiment, compiled, rows: dict, book: list) -> None:
    text = compiled.as_text()
    t = exp.config.train
    local = _local_rows_seq(exp)
    chunk = min(local[1], t.loss_chunk)
    small = 2 * 4 * local[0] * chunk
    for c in coll.collectives(text):
        if c.executed == 0:
            continue
        axes = group_axes(exp, c.groups[0])
        per = c.moved_bytes  # at the source dtype: what a GPU moves
        # Per-token loss statistics run once per loss chunk, never once per layer:
        # a small all-reduce inside the layer scan is a norm scale's gradient.
        if c.dtype[0] in "su" or (c.kind == "all-reduce" and c.bytes <= small
                                  and c.executed < exp.model_cfg.n_layers):
            book.append((c, axes, per))
            continue
        r = rows.setdefault((c.kind, axes), Row())
        r.hlo += c.bytes * c.executed
        r.bytes += per * c.executed
        r.ring += c.ring_bytes * c.executed


# ----- textbook ----------------------------------------------------------------------------


def _local_rows_seq(exp: Experiment) -> tuple[int, int]:
    t, mesh = exp.config.train, exp.mesh
    rows = t.batch_size // math.prod(mesh.shape[a] for a in exp.rules.axes_of("act_batch"))
    seq = t.seq_len // math.prod(mesh.shape[a] for a in exp.rules.axes_of("act_seq"))
    return rows, seq


def _spec_axes(spec) -> set[str]:
    out = set()
    for axes in spec:
        out.update((axes,) if isinstance(axes, str) else axes or ())
    return out


def textbook(exp: Experiment, rows: dict) -> None:
    mesh, rules, cfg = exp.mesh, exp.rules, exp.model_cfg
    order = lambda axes: tuple(a for a in mesh.axis_names if a in axes)  # noqa: E731
    data = {a for a in rules.data_axes if mesh.shape[a] > 1}
    compute_size = np.dtype(cfg.dtype).itemsize

    def add(kind, axes, nbytes):
        axes = order(axes)
        g = math.prod(mesh.shape[a] for a in axes)
        r = rows.setdefault((kind, axes), Row())
        r.textbook += nbytes
        r.ring_textbook += _ring(kind, g, nbytes)

    kv_repeat = rules.kv_repeat(cfg.n_kv_heads)
    for path, s in _leaves(exp.abstract_state.params):
        keys = [getattr(k, "key", k) for k in path]
        names = exp.param_names
        for k in keys:
            names = names[k]
        names = rules.stored_names(names, cfg.n_kv_heads)
        storage = _spec_axes(s.sharding.spec)
        grad_shard = math.prod(s.sharding.shard_shape(s.shape)) * 4
        sharded_data = storage & data
        if sharded_data:
            compute = NamedSharding(mesh, rules.compute_spec(names))
            gather_size = min(s.dtype.itemsize, compute_size)
            gathered = math.prod(compute.shard_shape(s.shape)) * gather_size
            uses = 2 if keys[0] == "layers" else 1
            add("all-gather", sharded_data, uses * gathered)
            add("reduce-scatter", sharded_data, grad_shard)
        if data - storage:
            add("all-reduce", data - storage, grad_shard)
        if kv_repeat > 1 and keys[-1] in ("wk", "wv"):
            # Each tensor shard's gradient covers the one head it uses: summed over
            # the kv_repeat shards that share it, gathered over the distinct heads.
            add("all-reduce", {"tensor"}, grad_shard / cfg.n_kv_heads)
            add("all-gather", {"tensor"}, grad_shard)
    b, s = _local_rows_seq(exp)
    if mesh.shape["tensor"] > 1:
        act = b * s * cfg.dim * compute_size
        add("all-reduce", {"tensor"}, act * (cfg.n_layers * (4 + (cfg.remat == "full")) + 2))
    c = mesh.shape["context"]
    if c > 1:
        kv_local = max(cfg.n_kv_heads // mesh.shape["tensor"], 1)
        block = b * s * kv_local * cfg.hd * compute_size
        recompute = 2 * (c - 1) if cfg.remat == "full" else 0
        blocks = 2 * (c - 1) + recompute + 2 * (c - 1) + 2 * c
        add("collective-permute", {"context"}, cfg.n_layers * blocks * block)


# ----- report ------------------------------------------------------------------------------


def _mib(x: float) -> str:
    return f"{x / MiB:,.2f}"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else ("-" if not a else "inf")


def run_shape(shape: str, model: dict, train: dict, layouts: dict) -> None:
    results = []
    for name, mesh in layouts.items():
        t0 = time.perf_counter()
        exp = experiment(model, train, mesh)
        compiled = exp.compiled_step
        seconds = time.perf_counter() - t0
        rows: dict = {}
        book: list = []
        measured(exp, compiled, rows, book)
        textbook(exp, rows)
        results.append((name, mesh, exp, memory(exp, compiled), rows, book, seconds))
        print(f"<!-- compiled {shape} {name} in {seconds:.1f} s -->", flush=True)
    cfg = results[0][2].model_cfg
    t = results[0][2].config.train
    print(f"\n### {shape}: vocab {cfg.vocab_size}, dim {cfg.dim}, {cfg.n_layers} layers, "
          f"{cfg.n_heads} heads / {cfg.n_kv_heads} kv heads, ffn {cfg.ffn_dim}; batch "
          f"{t.batch_size} x {t.seq_len}, bf16 compute, f32 params and moments, remat=full\n")
    print("Memory: parameters + optimizer state per device (MiB).\n")
    print("| layout | devices | sharded over (N) | total | per device | ideal total/N | "
          "ratio | arguments - batch | above ideal from |")
    print("|:--|--:|:--|--:|--:|--:|--:|--:|:--|")
    for name, _, exp, m, *_ in results:
        over = "; ".join(f"{k}: {_mib(v)}" for k, v in sorted(m["causes"].items())) or "-"
        axes = " x ".join(f"{a}" for a in m["axes"]) or "none"
        print(f"| {name} | {exp.mesh.devices.size} | {axes} ({m['n']}) | {_mib(m['total'])} | "
              f"{_mib(m['per_device'])} | {_mib(m['ideal'])} | "
              f"{m['per_device'] / m['ideal']:.4f} | {_mib(m['args_minus_batch'])} | {over} |")
    print("\nCommunication per step and device, by kind and mesh axes (MiB; result bytes "
          "per device x executions; bytes at the source dtype, CPU HLO's f32 widening "
          "undone). Ring: bytes each device sends with a ring algorithm.\n")
    print("| layout | kind | axes | CPU HLO | measured | textbook | ratio | ring measured | "
          "ring textbook | ring ratio |")
    print("|:--|:--|:--|--:|--:|--:|--:|--:|--:|--:|")
    for name, *_, rows, _book, _seconds in results:
        tot = [0.0, 0.0]
        for (kind, axes), r in sorted(rows.items()):
            tot[0] += r.ring
            tot[1] += r.ring_textbook
            print(f"| {name} | {kind} | {' x '.join(axes)} | {_mib(r.hlo)} | {_mib(r.bytes)} | "
                  f"{_mib(r.textbook)} | {_ratio(r.bytes, r.textbook)} | {_mib(r.ring)} | "
                  f"{_mib(r.ring_textbook)} | {_ratio(r.ring, r.ring_textbook)} |")
        print(f"| {name} | **all** | | | | | | **{_mib(tot[0])}** | **{_mib(tot[1])}** | "
              f"**{_ratio(*tot)}** |")
    print("\nBookkeeping (not in the table): kind, axes, dtype, bytes per execution x "
          "executions.\n")
    for name, *_, book, _seconds in results:
        items = [f"{c.kind} {'x'.join(a) or '-'} {c.dtype} {per:,.0f} B x {c.executed}"
                 for c, a, per in book]
        total = sum(per * c.executed for c, _, per in book)
        print(f"- {name}: {total / 1024:,.1f} KiB per step: " + "; ".join(items))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="smoke run: 2 layers, FSDP and TP")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated of "
                   f"{list(SHAPES)}")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated of "
                   f"{list(LAYOUTS)}")
    a = p.parse_args()
    print(f"jax {jax.__version__}, {platform.processor() or platform.machine()}, simulated "
          f"cpu devices; compiled ahead of time, nothing allocated")
    if a.tiny:
        shapes, layouts = SMOKE, {k: LAYOUTS[k] for k in ("FSDP", "TP")}
    else:
        shapes = {k: SHAPES[k] for k in a.shapes.split(",")}
        layouts = {k: LAYOUTS[k] for k in a.layouts.split(",")}
    for shape, (model, train) in shapes.items():
        run_shape(shape, model, train, layouts)


if __name__ == "__main__":
    main()
