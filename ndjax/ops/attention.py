"""Attention kernels by name: ``model.attn_impl`` picks one, ``auto`` chooses.

Every kernel computes the same function, causal grouped-query attention over
packed documents: a token attends to itself and earlier tokens with its own
segment id. Shapes: q (b, s, h, d); k, v (b, s, kv, d), h a multiple of kv;
segment_ids (b, s). Each is tested against ``dense`` (tests/test_attention.py).

A layer may ask for more (``AttentionSpec``): a sliding window (Hugging Face's
``sliding_window``: a query at p sees keys p - window < k <= p of its document), a
soft cap on the scores, another score scale, learned attention sinks (GPT-OSS: a
logit per head that joins each row's softmax as a column whose value is zero).
What each kernel computes exactly:

=========  ======  ========  =====  =====  ===================================================
kernel     window  soft cap  scale  sinks  with a window
=========  ======  ========  =====  =====  ===================================================
dense      yes     yes       yes    yes    the whole score matrix, masked
blocked    yes     yes       yes    yes    chunks of the window's length, O(seq x window)
tiled      yes     no        yes    yes    only the key tiles in reach, O(seq x (window+tile))
ring       yes     no        yes    yes    the same per block; blocks out of reach skipped
cudnn      yes     no        yes    no     cuDNN's sliding_window_length
pallas     no      no        yes    no     (jax's Pallas kernel has no window)
=========  ======  ========  =====  =====  ===================================================

Sinks: the dense-style kernels (dense, blocked) add the sink's column to each
row's softmax; the flash-style ones (tiled, ring) fold it into each row's running
statistics once, after every key, and their backward gives its gradient from the
output and log-sum-exp. All-to-all context parallelism hands each device the sink
logits of the heads it attends for.

A kernel brings what the rest of ndjax needs to know about it, so that neither
``Experiment`` nor the model knows any kernel's internals:

* ``check(site)``: a one-line ConfigError, before anything compiles, where it
  cannot run: the platform, mesh or shapes (``check_site``), or a spec of the
  model's layers (``Site.specs``) it does not compute (``check_spec``: the fields
  it ``honours``), with the kernels that do;
* ``permutation(site)``: the host-side order of the sequence it needs (ring
  attention's zigzag layout), applied to every batch by ``Experiment.device_batch``;
* ``__call__(q, k, v, segment_ids, cfg, spec, sinks=None)``: the attention itself,
  with the layer's spec (and its sink logits, (heads,), where ``spec.sinks``),
  traced inside the model under the active rule table.

``auto`` (``choose``) takes, in order: ``ring`` when the rules split the sequence
over ``mesh.context``; on a GPU the first fused kernel whose check passes,
``cudnn`` then ``pallas``; else by the tokens per row: ``dense`` up to
``DENSE_MAX_SEQ``, ``blocked`` (dense without the causally masked blocks) up to
``BLOCKED_MAX_SEQ``, and ``tiled`` above, whose memory is linear in the sequence
(``blocked`` where tiled's check fails, e.g. for a soft cap). Every choice has
passed its check, the model's specs included.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from ndjax.ops import all_to_all_attention as a2a
from ndjax.ops import kernel_vjp
from ndjax.ops import ring_attention as ring
from ndjax.parallel import mesh as mesh_lib
from ndjax.parallel import platforms
from ndjax.parallel.rules import Rules, active, axes_of, suspended
from ndjax.runtime.errors import ConfigError

# The logical names of q (and the output), and of k and v, (b, s, heads, head_dim).
HEADS = ("act_batch", "act_seq", "act_heads", "act_head_dim")
KV_HEADS = ("act_batch", "act_seq", "act_kv_heads", "act_head_dim")

# auto on one context shard, off a GPU: dense up to DENSE_MAX_SEQ tokens per row,
# blocked up to BLOCKED_MAX_SEQ, tiled above (memory linear in seq). Measured on CPU
# in the whole train step (bench/cpu_step_variants.py: issue 14's model, 2,048
# tokens per step): BENCHMARKS.md, "What closed the gap". At 256 tokens blocked's speed
# is dense's give or take 10% (0.92x, 1.00x and 1.10x in three runs, no consistent
# sign) while its 8 query blocks a layer triple the step's compile (4.8 -> 14.6 s):
# what a short CPU run waits for most. From 512 it leads in every run.
DENSE_MAX_SEQ = 256
BLOCKED_MAX_SEQ = 1024
# The blocked kernel's most query blocks per row.
MAX_QUERY_BLOCKS = 8
# Pallas's largest forward block (queries and keys), and the shared memory its
# forward blocks may take (pallas_block_sizes).
PALLAS_BLOCK = 128
PALLAS_SMEM = 200 * 1024


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """What one layer's attention computes, beyond causal grouped-query attention
    within packed documents. A kernel honours every field or refuses the spec with
    a one-line ConfigError before anything compiles (``Kernel.check``).

    ``window``: a query at position p sees keys at p - window < k <= p (Hugging
    Face's ``sliding_window``, Mistral's and Gemma's local layers); None: every
    earlier key. ``softcap``: scores become ``softcap * tanh(scores / softcap)``
    before the softmax (Gemma 2's ``attn_logit_softcapping``). ``scale``: the
    scores' factor; None: 1 / sqrt(head_dim) (Gemma 3 sets
    ``query_pre_attn_scalar ** -0.5``). ``sinks``: the rows' softmax has a learned
    per-head sink logit (GPT-OSS): a column of the softmax whose value vector is
    zero, given to ``attention`` as ``sinks`` (n_heads,)."""

    causal: bool = True
    window: int | None = None
    softcap: float | None = None
    scale: float | None = None
    sinks: bool = False

    def scale_for(self, head_dim: int) -> float:
        return self.scale if self.scale is not None else 1 / math.sqrt(head_dim)

    def at(self, seq_len: int) -> AttentionSpec:
        """What this spec computes in rows of ``seq_len`` tokens: a window that hides
        no key there (window >= seq_len) is no window, so it rules out no kernel."""
        if self.window is not None and self.window >= seq_len:
            return dataclasses.replace(self, window=None)
        return self


@dataclasses.dataclass(frozen=True)
class Site:
    """Where attention runs, as far as a kernel's choice depends on it; all known
    before compiling."""

    seq_len: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    dtype: Any             # compute dtype of q, k, v
    context: int           # shards of the sequence inside attention
    platform: str          # jax.default_backend(): cpu | gpu | tpu
    layout: str            # ring attention's sequence layout (model.cp_layout)
    kv_tile: int           # the tiled and ring kernels' key tile (model.attn_kv_tile)
    compute_capability: str | None = None  # of the first GPU, e.g. "9.0"
    rows: int = 0          # rows attention runs on at once (a micro-batch), 0: unknown
    devices: int = 1       # of the mesh
    # The distinct specs of the model's layers: a kernel runs only if it honours all.
    specs: tuple[AttentionSpec, ...] = (AttentionSpec(),)
    # How context shards meet (model.cp_impl): ring | all_to_all | auto.
    cp_impl: str = "auto"
    # Ways the rule table splits the query heads (tensor parallelism).
    head_shards: int = 1
    # Pipeline stages (mesh.stage): the layers run vmapped over them.
    stages: int = 1

    @property
    def heads_per_shard(self) -> int:
        return self.n_heads // max(1, self.head_shards)

    def one_shard(self) -> Site:
        """Where the kernel inside all-to-all attention runs: one device, the whole
        sequence, its share of the heads."""
        heads = max(1, self.heads_per_shard // self.context)
        return dataclasses.replace(self, context=1, n_heads=heads,
                                   n_kv_heads=min(self.n_kv_heads, heads), devices=1)

    @classmethod
    def of(cls, cfg: Any, seq_len: int, rules: Rules | None, rows: int = 0) -> Site:
        """``cfg``: an ``ndjax.models.llama.LlamaConfig``. The platform is that of the
        rules' mesh (the devices the step is built for), else jax's default."""
        devices = list(rules.mesh.devices.flat) if rules is not None else jax.devices()
        return cls(seq_len=seq_len, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                   head_dim=cfg.hd, dtype=jnp.dtype(cfg.dtype),
                   context=ring.context_shards(rules), platform=platforms.of(devices),
                   layout=cfg.cp_layout, kv_tile=cfg.attn_kv_tile,
                   compute_capability=platforms.compute_capability(devices), rows=rows,
                   devices=len(devices) if rules is not None else 1,
                   specs=tuple(getattr(cfg, "attention_specs", (AttentionSpec(),))),
                   cp_impl=getattr(cfg, "cp_impl", "auto"), head_shards=_head_shards(rules),
                   stages=mesh_lib.stages(rules.mesh) if rules is not None else 1)


def _head_shards(rules: Rules | None) -> int:
    if rules is None:
        return 1
    return math.prod(rules.mesh.shape[a] for a in rules.axes_of("act_heads"))


def _at_least(capability: str | None, target: tuple[int, int]) -> bool:
    if not capability:
        return False
    return tuple(int(x) for x in capability.split(".")[:2]) >= target


def _largest_divisor(n: int, at_most: int) -> int:
    """The tile to suggest when ``at_most`` does not divide ``n``."""
    return max(t for t in range(1, at_most + 1) if n % t == 0)


def _field(name: str) -> str:
    return f"model.attn_impl={name!r}"


# ----- the kernels ---------------------------------------------------------------------------


# An AttentionSpec field, in words, for a kernel that refuses it.
_FEATURES = {"window": "sliding window", "softcap": "logit soft cap", "scale": "score scale",
             "sinks": "attention sinks"}
_PLATFORM_WORDS = {"cpu": "CPUs", "gpu": "NVIDIA GPUs", "tpu": "TPUs"}


class Kernel:
    """What a kernel is and can do, as data that ``choose``, the planner and the
    roofline read (no kernel is named outside its class), and its checks."""

    name = ""
    what = ""  # a few words for the start-up line
    # The AttentionSpec fields this kernel computes when they are set; check refuses
    # a model whose layers set any other.
    honours: tuple[str, ...] = tuple(_FEATURES)
    # The platforms it runs on (platforms.of: cpu | gpu | tpu).
    platforms: tuple[str, ...] = ("cpu", "gpu", "tpu")
    # A fused GPU kernel: auto takes the first whose check passes on a GPU, in
    # KERNELS' order, and inside all-to-all context parallelism.
    fused = False
    # Runs on a sequence split over mesh.context itself (its own collectives).
    context_parallel = False
    # The checkpoint names of what it saves for its backward pass: a kernel with its
    # own VJP saves its output and log-sum-exp through ``kernel_vjp`` (so remat
    # policies that save ``attn_out`` and ``attn_lse`` never rerun it); the plain
    # kernels, their softmax probabilities.
    saves: tuple[str, ...] = ("attn_probs",)
    # What a compile on other devices (the planner's CPU compiles) runs in its place:
    # the same memory order and no kernel of the other platform's.
    stand_in: str | None = None

    def check(self, site: Site) -> None:
        """Raises ConfigError (one line: field, values, fix) where it cannot run: the
        platform, the kernel's own limits there (``check_site``), or a spec of the
        model's layers that it does not compute exactly (``check_spec``)."""
        if site.platform not in self.platforms:
            where = " and ".join(_PLATFORM_WORDS[p] for p in self.platforms)
            raise ConfigError(
                f"{_field(self.name)} runs on {where}, and this run's devices are "
                f"{site.platform}. Use model.attn_impl='auto' (tiled or dense on CPU).")
        self.check_site(site)
        for spec in site.specs:
            self.check_spec(spec.at(site.seq_len))

    def check_site(self, site: Site) -> None:
        """Raises ConfigError where the platform, mesh or shapes rule the kernel out."""

    def check_spec(self, spec: AttentionSpec) -> None:
        """Raises ConfigError unless the kernel computes ``spec`` exactly."""
        if not spec.causal:
            raise ConfigError(
                f"{_field(self.name)} computes causal attention, and the model's attention "
                "has causal=False (AttentionSpec). Every ndjax kernel is causal: use a "
                "decoder-only model.")
        if spec.window is not None and spec.window < 1:
            raise ConfigError(
                f"The model's attention has window={spec.window} (AttentionSpec), and a "
                "query sees the keys p - window < k <= p, itself at least. Use window >= 1, "
                "or None for no window.")
        if spec.softcap is not None and spec.softcap <= 0:
            raise ConfigError(
                f"The model's attention has softcap={spec.softcap} (AttentionSpec), and "
                "scores are capped as softcap * tanh(scores / softcap). Use softcap > 0, "
                "or None for no cap.")
        for field, feature in _FEATURES.items():
            value = getattr(spec, field)
            unset = value is None or value is False  # sinks=False: no sinks
            if not unset and field not in self.honours:
                raise ConfigError(
                    f"{_field(self.name)} has no {feature}, and the model's attention sets "
                    f"{field}={value!r} (AttentionSpec). {self._instead(field)}")

    def _instead(self, field: str) -> str:
        """The fix for a refused spec field: the one-shard kernels that compute it."""
        names = [repr(n) for n, k in KERNELS.items()
                 if field in k.honours and not k.context_parallel]
        use = f"model.attn_impl={', '.join([repr('auto'), *names[:-1]])} or {names[-1]}"
        if self.context_parallel:
            return f"Use model.cp_impl='all_to_all' (or mesh.context=1) and {use}."
        return f"Use {use}."

    def permutation(self, site: Site) -> np.ndarray | None:
        return None

    def max_runs(self, cfg: Any) -> int | None:
        """The most runs of equal segment ids (the padding at a row's end counted as
        one) that a row may hold for this kernel, or None where any number is fine.
        The data's packers close a row rather than exceed it (``make_loader``)."""
        return None

    def check_batch(self, segment_ids: np.ndarray, cfg: Any) -> None:
        """Raises ConfigError where a batch's rows (host-side segment ids, b x s)
        are beyond what the compiled kernel makes room for: a defensive check, since
        the packers keep rows within ``max_runs``."""

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                 cfg: Any, spec: AttentionSpec = AttentionSpec(),
                 sinks: jax.Array | None = None) -> jax.Array:
        """``sinks``: (heads,) sink logits, given exactly where ``spec.sinks``."""
        raise NotImplementedError


def _no_sinks(kernel: Kernel, sinks: jax.Array | None) -> None:
    """A kernel without sinks called with them: check_spec's refusal."""
    if sinks is not None:
        kernel.check_spec(AttentionSpec(sinks=True))


def _one_shard(name: str, site: Site) -> None:
    if site.context > 1:
        raise ConfigError(
            f"{_field(name)} runs on one context shard, but the rules split the sequence over "
            f"mesh.context={site.context}. Use model.cp_impl='all_to_all' (this kernel over "
            "the whole sequence for a slice of the heads), or model.attn_impl='ring' (or "
            "'auto').")


def _window(spec: AttentionSpec, seq_len: int) -> int | None:
    """The spec's window where it hides keys in a row of ``seq_len`` tokens, else None."""
    return spec.at(seq_len).window


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *,
                     scale: float | None = None, softcap: float | None = None,
                     sinks: jax.Array | None = None) -> jax.Array:
    """Grouped-query attention of q (b, s, h, d) over k, v (b, t, kv, d) where ``mask``
    (b, s, t) allows, with the whole (s x t) score matrix; softmax in float32.
    ``scale``: the scores' factor (None: 1 / sqrt(d)); ``softcap``: scores become
    softcap * tanh(scores / softcap); ``sinks`` (h,): each head's sink logit, one more
    column of every row's softmax whose value is zero (transformers' GPT-OSS)."""
    b, s, h, d = q.shape
    kv = k.shape[2]
    q = q.reshape(b, s, kv, h // kv, d)
    # The score matrices' order: on CPU (kv head, query, group, key), the order the
    # dot produces them in (batch dims, then the query's free dims as q stores
    # them), so that neither they nor the probabilities and their gradients are
    # ever transposed; measured by bench/cpu_vs_torch.py. Elsewhere (query group,
    # query, key), as GPUs have run it.
    scores_order = "bksgt" if platforms.current() == "cpu" else "bkgst"
    scores = jnp.einsum(f"bskgd,btkd->{scores_order}", q, k, preferred_element_type=jnp.float32)
    key_mask = mask[:, None, :, None] if scores_order == "bksgt" else mask[:, None, None]
    scores = ring.scale_scores(scores, scale, d)
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    scores = jnp.where(key_mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1) if sinks is None else _sink_softmax(
        scores, sinks.astype(jnp.float32).reshape(kv, h // kv), scores_order)
    # Named so that remat=none keeps it (ndjax.models.llama.REMAT_POLICIES).
    probs = checkpoint_name(probs.astype(v.dtype), "attn_probs")
    out = jnp.einsum(f"{scores_order},btkd->bskgd", probs, v)
    return out.reshape(b, s, h, d)


def _sink_softmax(scores: jax.Array, sinks: jax.Array, scores_order: str) -> jax.Array:
    """The softmax over the keys and the sink (``sinks`` (kv, g) float32), the sink's
    column left out: its value vector is zero, so it only adds to the denominator.
    No concatenated (t + 1) copy of the scores; autodiff gives the sink's gradient."""
    sink = sinks[None, :, None, :] if scores_order == "bksgt" else sinks[None, :, :, None]
    # The shift cancels in the ratio: no gradient through it (as jax.nn.softmax).
    m = jax.lax.stop_gradient(jnp.maximum(scores.max(-1), sink))
    e = jnp.exp(scores - m[..., None])
    return e / (e.sum(-1) + jnp.exp(sink - m))[..., None]


def _spec_attention(q, k, v, mask, spec: AttentionSpec, sinks=None) -> jax.Array:
    return masked_attention(q, k, v, mask, scale=spec.scale, softcap=spec.softcap, sinks=sinks)


def dense(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
          spec: AttentionSpec = AttentionSpec(), sinks: jax.Array | None = None) -> jax.Array:
    """The reference: causal within each document (and ``spec``'s window), the whole
    score matrix."""
    idx = jnp.arange(q.shape[1])
    mask = ring.allowed(idx, segment_ids, idx, segment_ids, _window(spec, q.shape[1]))
    return _spec_attention(q, k, v, mask, spec, sinks)


class Dense(Kernel):
    name, what = "dense", "the whole score matrix, O(seq^2) memory"

    def __call__(self, q, k, v, segment_ids, cfg, spec=AttentionSpec(), sinks=None):
        return dense(q, k, v, segment_ids, spec, sinks)


def query_blocks(seq_len: int) -> int:
    """How many query blocks ``blocked`` cuts a row into: the most, up to
    ``MAX_QUERY_BLOCKS``, that divide it evenly."""
    return _largest_divisor(seq_len, MAX_QUERY_BLOCKS)


def _first_key(start: int, window: int | None) -> int:
    """The first key any query from ``start`` on can see."""
    return 0 if window is None else max(0, start - window + 1)


def _blocks_work(seq_len: int, blocks: int, window: int | None) -> int:
    """Scores ``blocked``'s query blocks compute."""
    size = seq_len // blocks
    return sum(size * ((i + 1) * size - _first_key(i * size, window)) for i in range(blocks))


def _chunks_work(seq_len: int, window: int) -> int:
    """Scores ``window_chunks`` computes: chunks of ``window`` queries x 2 chunks of keys."""
    return -(-seq_len // window) * window * 2 * window


def key_ranges(seq_len: int, blocks: int, window: int | None = None
               ) -> list[tuple[int, ...]]:
    """Per query block of ``blocked``, the key ranges it may compute, as their first
    keys, the shorter first: from the previous block's first key (its own block and
    the previous one), and from the first key its window (or the row) lets it see.
    Each is one static branch of a ``lax.switch`` (``picked_key_ranges`` chooses),
    compiled whether it runs or not: so the shorter range is offered only where it
    leaves out a block of keys at least, and not its own block alone, which would
    serve only where a document starts at the block's first query in every row."""
    size = seq_len // blocks
    out = []
    for i in range(blocks):
        first = _first_key(i * size, window)
        short = (i - 1) * size
        out.append((short, first) if short - first >= size else (first,))
    return out


def picked_key_ranges(segment_ids: jax.Array, blocks: int, window: int | None = None
                      ) -> jax.Array:
    """Document-aware skipping in ``blocked``: per query block, which of its
    ``key_ranges`` it computes (an index, int32 (blocks,)): the shortest whose keys
    left out cannot share a document with the block's queries in any row. Segment-id
    ranges that do not overlap hold no common id, so every key left out is masked
    and leaving it out changes no allowed score. On rows of documents no longer than
    a block that is the block's own and the previous one: 2 blocks of keys per query
    block instead of i + 1. A row's padding (segment 0 at its end) meets
    every range below it: the block holding it takes its full range."""
    seq = segment_ids.shape[1]
    size = seq // blocks
    picked = []
    for i, starts in enumerate(key_ranges(seq, blocks, window)):
        ids = segment_ids[:, i * size:(i + 1) * size]
        q_lo, q_hi = ids.min(1), ids.max(1)
        free = []
        for start in starts[:-1]:
            out = segment_ids[:, starts[-1]:start]   # the keys this range leaves out
            meet = jnp.maximum(q_lo, out.min(1)) <= jnp.minimum(q_hi, out.max(1))
            free.append(~meet.any())
        picked.append(jnp.argmax(jnp.stack([*free, jnp.bool_(True)])))
    return jnp.stack(picked).astype(jnp.int32)


def blocked(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
            blocks: int, spec: AttentionSpec = AttentionSpec(),
            sinks: jax.Array | None = None) -> jax.Array:
    """``dense``'s function, as ``blocks`` query blocks, block i against the keys up to
    its own last query. The score blocks above the diagonal, every entry masked by
    causality, are never computed: (blocks + 1) / (2 blocks) of dense's work and
    memory. Each query row still takes one softmax over the same allowed keys.

    Packed rows: a block also leaves out the earlier keys its documents cannot reach
    (``picked_key_ranges``, one ``lax.switch`` per block among ``key_ranges``). The
    keys left out are all masked, so the function is the same; the softmax then sums
    over fewer (zero) terms, which may move results by float32 rounding.

    With a window, a block starts at the first key its first query sees; where chunks
    of the window's length do less work (``window_chunks``: O(seq x window), however
    long the row) they run instead. ``sinks``: ``masked_attention``'s, each query
    row's softmax being whole in its block."""
    seq = q.shape[1]
    window = _window(spec, seq)
    if window is not None and _chunks_work(seq, window) < _blocks_work(seq, blocks, window):
        return window_chunks(q, k, v, segment_ids, window, spec, sinks)
    size = seq // blocks
    idx = jnp.arange(seq)
    picked = picked_key_ranges(segment_ids, blocks, window)
    outs = []
    for i, starts in enumerate(key_ranges(seq, blocks, window)):
        rows, first, end = slice(i * size, (i + 1) * size), starts[-1], (i + 1) * size

        def attend(start, q, k, v, k_seg, q_seg, sinks, rows=rows, first=first, end=end):
            # k, v, k_seg: the keys from ``first``; this range's are their last ones.
            keys = slice(start - first, end - first)
            mask = ring.allowed(idx[rows], q_seg, idx[start:end], k_seg[:, keys], window)
            return _spec_attention(q, k[:, keys], v[:, keys], mask, spec, sinks)

        branches = [functools.partial(attend, start) for start in starts]
        keys = slice(first, end)
        args = (q[:, rows], k[:, keys], v[:, keys], segment_ids[:, keys], segment_ids[:, rows],
                sinks)
        outs.append(branches[0](*args) if len(branches) == 1 else
                    jax.lax.switch(picked[i], branches, *args))
    return jnp.concatenate(outs, axis=1)


def window_chunks(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                  window: int, spec: AttentionSpec, sinks: jax.Array | None = None
                  ) -> jax.Array:
    """``dense``'s function with a window shorter than the row: the row cut into chunks
    of ``window`` queries (the last padded), each against the keys of its own and the
    previous chunk, which hold every key its queries can see (p - window < k <= p).
    All chunks at once, as a batch: work and memory O(seq x window)."""
    b, s, h, d = q.shape
    n = -(-s // window)
    pad = n * window - s

    def chunked(x, before: int):  # (b, s, ...) -> (b, n + before, window, ...)
        x = jnp.pad(x, [(0, 0), (before * window, pad)] + [(0, 0)] * (x.ndim - 2))
        return x.reshape(b, n + before, window, *x.shape[2:])

    def two(x):  # chunk i's keys: padded chunks i - 1 and i, (b * n, 2 window, ...)
        x = chunked(x, 1)
        x = jnp.concatenate([x[:, :-1], x[:, 1:]], axis=2)
        return x.reshape(b * n, 2 * window, *x.shape[3:])

    q_idx = jnp.arange(n * window).reshape(n, window)
    k_idx = jnp.arange(-window, n * window).reshape(n + 1, window)
    k_idx = jnp.concatenate([k_idx[:-1], k_idx[1:]], axis=1)
    seen = ((q_idx[:, :, None] >= k_idx[:, None, :]) & (q_idx[:, :, None] - k_idx[:, None, :]
                                                        < window)
            & (k_idx[:, None, :] >= 0) & (k_idx[:, None, :] < s))  # padding is no key
    same = chunked(segment_ids, 0)[:, :, :, None] == two(segment_ids).reshape(
        b, n, 1, 2 * window)
    mask = (seen[None] & same).reshape(b * n, window, 2 * window)
    out = _spec_attention(chunked(q, 0).reshape(b * n, window, h, d), two(k), two(v), mask,
                          spec, sinks)
    return out.reshape(b, n * window, h, d)[:, :s]


class Blocked(Kernel):
    name, what = "blocked", "dense over causal query blocks, the masked blocks skipped"

    def check_site(self, site):
        _one_shard(self.name, site)

    def __call__(self, q, k, v, segment_ids, cfg, spec=AttentionSpec(), sinks=None):
        run = functools.partial(blocked, blocks=query_blocks(q.shape[1]), spec=spec)
        return _per_shard(run, q, k, v, segment_ids, sinks)


class Tiled(Kernel):
    """Ring attention's kernel on one shard, in its zigzag layout with one shard: the
    sequence as two halves, so the (first half's queries x second half's keys) block,
    all masked, is skipped rather than computed."""

    name, what = "tiled", "online softmax over key tiles, memory linear in seq"
    honours = ("window", "scale", "sinks")
    saves = kernel_vjp.RESIDUALS

    def check_site(self, site):
        _one_shard(self.name, site)
        if site.seq_len % 2:
            raise ConfigError(
                f"train.seq_len={site.seq_len} is odd, and {_field(self.name)} works on its two "
                f"halves. Use an even train.seq_len, or model.attn_impl='dense'.")
        half = site.seq_len // 2
        tile = min(half, site.kv_tile)
        if half % tile:
            fit = _largest_divisor(half, tile)
            raise ConfigError(
                f"model.attn_kv_tile={site.kv_tile} does not divide half of train.seq_len="
                f"{site.seq_len} ({half} tokens, {_field(self.name)}). Use a divisor, e.g. "
                f"model.attn_kv_tile={fit}.")

    def __call__(self, q, k, v, segment_ids, cfg, spec=AttentionSpec(), sinks=None):
        # zigzag on one shard is the identity order: no permutation of the batch.
        run = functools.partial(ring.ring_attention, mesh=None, layout="zigzag",
                                kv_tile=cfg.attn_kv_tile, window=spec.window, scale=spec.scale)
        return _per_shard(run, q, k, v, segment_ids, sinks)


class Ring(Kernel):
    name, what = "ring", "ring attention over the context axis"
    honours = ("window", "scale", "sinks")
    context_parallel = True
    saves = kernel_vjp.RESIDUALS

    def check_site(self, site):
        seq_len, context, layout = site.seq_len, site.context, site.layout
        pieces = ring.PIECES[layout]
        ways = pieces * context
        if seq_len % ways:
            what = (f"2 x mesh.context({context}) = {ways}: model.cp_layout='zigzag' cuts it "
                    "into 2 chunks per context shard" if pieces == 2 else
                    f"mesh.context({context})")
            raise ConfigError(
                f"train.seq_len={seq_len} is not divisible by {what}. Use a multiple of {ways}, "
                f"e.g. train.seq_len={(seq_len // ways + 1) * ways}"
                + (", or model.cp_layout='contiguous'." if pieces == 2 else "."))
        piece, tile = ring.piece_len(layout, seq_len, context), site.kv_tile
        if tile < piece and piece % tile:
            fit = _largest_divisor(piece, tile)
            raise ConfigError(
                f"model.attn_kv_tile={tile} does not divide ring attention's block of {piece} "
                f"tokens (train.seq_len={seq_len} / ({pieces} x mesh.context={context}), "
                f"model.cp_layout={layout!r}). Use a divisor of {piece}, e.g. "
                f"model.attn_kv_tile={fit}.")

    def permutation(self, site):
        return ring.layout_permutation(site.layout, site.seq_len, site.context)

    def __call__(self, q, k, v, segment_ids, cfg, spec=AttentionSpec(), sinks=None):
        rules = active()
        kw = dict(layout=cfg.cp_layout, kv_tile=cfg.attn_kv_tile, window=spec.window,
                  scale=spec.scale)
        if ring.context_shards(rules) == 1:
            run = functools.partial(ring.ring_attention, mesh=None, **kw)
            return _per_shard(run, q, k, v, segment_ids, sinks)
        # Each device's rows and heads, as the rule table splits them; heads the table
        # splits unlike the kv heads are gathered (each device computes them all).
        axis = "context"
        (rows, _, heads, _), (_, _, kv_heads, _) = _splits(rules)
        rows = tuple(a for a in rows if a != axis)
        heads = tuple(a for a in heads if a != axis) if heads == kv_heads else ()
        return ring.ring_attention(q, k, v, segment_ids, mesh=rules.mesh, axis=axis,
                                   rows=rows, heads=heads, sinks=sinks, **kw)


def segment_runs(segment_ids: jax.Array, max_runs: int) -> tuple[jax.Array, jax.Array]:
    """Packed rows in cuDNN's ragged form: each run of equal segment ids is one
    sequence. Returns (lengths (b, max_runs), starts (b, max_runs + 1)), both int32,
    -1 past each row's last run: the ``q_seqlen`` / ``q_offsets`` of jax's cuDNN
    attention. Padding tokens (segment id 0 at the end of a row) form a run of their
    own, so every token belongs to a sequence and gets a finite output.

    ``max_runs`` sizes cuDNN's saved softmax statistics, (b x max_runs, heads, s)
    float32 per layer: room for every possible run (s) would make them O(s^2). A row
    with more runs is never packed (``Kernel.max_runs``), and refused on the host
    (``Cudnn.check_batch``) before it gets here."""
    b, s = segment_ids.shape
    first = jnp.ones((b, 1), bool)
    is_start = jnp.concatenate([first, segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)

    def row(starts_mask):
        count = jnp.minimum(starts_mask.sum(), max_runs)
        starts = jnp.nonzero(starts_mask, size=max_runs, fill_value=-1)[0].astype(jnp.int32)
        offsets = jnp.concatenate([starts, jnp.full((1,), -1, jnp.int32)]).at[count].set(s)
        lengths = jnp.where(jnp.arange(max_runs) < count, offsets[1:] - offsets[:-1], -1)
        return lengths.astype(jnp.int32), offsets

    return jax.vmap(row)(is_start)


def runs_per_row(segment_ids: np.ndarray) -> np.ndarray:
    """Host side: how many runs of equal segment ids each row of (b, s) holds."""
    return (segment_ids[:, 1:] != segment_ids[:, :-1]).sum(axis=1) + 1


def _cudnn_packed(q, k, v, lengths, offsets, *, scale: float, window: int | None
                  ) -> tuple[jax.Array, jax.Array]:
    """jax's own cuDNN entry point with sequence offsets (the public
    jax.nn.dot_product_attention takes lengths but not packed documents): (output,
    softmax statistics)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    # sliding_window_length=w: a token at pos sees (pos - w, pos] of its own sequence
    # (cuDNN's diagonal band, left bound w), HF's sliding_window exactly. Positions
    # count from the sequence's offset in queries and keys alike, so the distance
    # between a query and a key is the same as in the packed row.
    return cudnn.dot_product_attention(
        q, k, v, None, None, lengths, lengths, offsets, offsets, scale=scale,
        mask_type=cudnn.MaskType.PADDING_CAUSAL, sliding_window_length=window,
        return_residual=True)


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                    max_docs: int, scale: float, window: int | None) -> jax.Array:
    """cuDNN's fused attention over packed rows, its residuals named (``kernel_vjp``):
    jax's cuDNN VJP saves the output and softmax statistics unnamed, so remat would
    run its forward again to rebuild them. Its pullback is the residual here, with
    those two leaves named."""
    def forward(q, k, v, segment_ids):
        lengths, offsets = segment_runs(segment_ids, max_docs)
        (out, stats), pullback = jax.vjp(functools.partial(
            _cudnn_packed, lengths=lengths, offsets=offsets, scale=scale, window=window),
            q, k, v)
        return out, stats, pullback

    def backward(args, out, stats, pullback, d_out):
        return (*pullback((d_out, jnp.zeros_like(stats))), None)

    return kernel_vjp.named_residuals(forward, backward)(q, k, v, segment_ids)


class Cudnn(Kernel):
    name, what = "cudnn", "cuDNN flash attention, packed rows as ragged sequences"
    honours = ("window", "scale")
    platforms, fused, saves, stand_in = ("gpu",), True, kernel_vjp.RESIDUALS, "tiled"

    def check_site(self, site):
        _one_shard(self.name, site)
        dtype = jnp.dtype(site.dtype)
        if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            raise ConfigError(
                f"{_field(self.name)} needs bfloat16 or float16 compute, and model.dtype is "
                f"{dtype.name}. Set model.dtype=bfloat16, or model.attn_impl='pallas'.")
        hopper = _at_least(site.compute_capability, (9, 0))
        most = 256 if hopper else 128
        if site.head_dim % 8 or site.head_dim > most:
            raise ConfigError(
                f"{_field(self.name)} needs a head_dim that is a multiple of 8 and at most "
                f"{most} on this GPU, and the model's is {site.head_dim}. Use "
                "model.attn_impl='pallas' or 'tiled'.")
        if not hopper:
            raise ConfigError(
                f"{_field(self.name)}: cuDNN attends within packed documents only on Hopper "
                f"or newer GPUs (compute capability >= 9.0), and this one is "
                f"{site.compute_capability}. Use model.attn_impl='pallas'.")
        if site.stages > 1:
            # A pipeline vmaps the layers over its stages, and jax's batching rule for
            # cuDNN attention reshapes the documents' lengths wrongly (compiled for H100s).
            raise ConfigError(
                f"{_field(self.name)} cannot run inside pipeline stages (mesh.stage="
                f"{site.stages}): jax's cuDNN attention has no working vmap rule. Use "
                "model.attn_impl='pallas' or 'tiled' (auto picks them).")
        if site.rows == 1 and site.devices > 1:
            # jax's sharding rule for cuDNN's saved statistics, (rows x documents,
            # heads, seq), fails to verify when rows is 1 (compiled for H100s).
            raise ConfigError(
                f"{_field(self.name)} cannot be partitioned over {site.devices} devices with "
                "one row per micro-batch (jax's cuDNN sharding rule fails for it). Use "
                "train.batch_size / train.grad_accum >= 2, or model.attn_impl='pallas'.")

    def max_runs(self, cfg):
        # The rows of cuDNN's saved softmax statistics that the compiled step makes.
        return cfg.attn_max_docs

    def check_batch(self, segment_ids, cfg):
        runs = runs_per_row(segment_ids)
        worst = int(runs.argmax())
        if runs[worst] > cfg.attn_max_docs:
            raise ConfigError(
                f"model.attn_max_docs={cfg.attn_max_docs}: a batch row holds {runs[worst]} "
                f"documents (runs of one segment id, the padding counted as one), more than "
                f"{_field(self.name)} made room for. Raise model.attn_max_docs (cuDNN keeps "
                f"max_docs x seq_len softmax statistics per head and layer), or use "
                f"model.attn_impl='pallas' or 'tiled'.")

    def __call__(self, q, k, v, segment_ids, cfg, spec=AttentionSpec(), sinks=None):
        _no_sinks(self, sinks)
        return cudnn_attention(q, k, v, segment_ids, max_docs=min(cfg.attn_max_docs, q.shape[1]),
                               scale=spec.scale_for(q.shape[-1]),
                               window=_window(spec, q.shape[1]))


@functools.cache
def pallas_available() -> bool:
    """Whether this jax has the Pallas Triton attention kernel
    (``jax.experimental.pallas.ops.gpu.attention``; jax 0.12.1 removed it)."""
    try:
        from jax.experimental.pallas.ops.gpu import attention  # noqa: F401
    except ImportError:
        return False
    return True


def pallas_block_sizes(seq_len: int, head_dim: int, dtype: Any) -> Any:
    """Pallas's blocks for this shape. The forward kernel holds a query block and,
    double-buffered, a key and a value block: about 5 blocks of (rows x head bytes)
    in shared memory, kept under ``PALLAS_SMEM`` (a Hopper SM has 227 KiB for one
    block). The backward's blocks, which hold more at once, are smaller still.
    Compiled for an H100 at head_dim 64, 128 and 256 in bfloat16 and float32:
    tests/test_gpu_compile.py."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_gpu

    wide = head_dim * jnp.dtype(dtype).itemsize  # bytes of one row of a head
    forward = min(PALLAS_BLOCK, 1 << max(4, (PALLAS_SMEM // (5 * wide)).bit_length() - 1))
    backward = 32 if wide <= 512 else 16
    fwd, back = min(forward, seq_len), min(backward, seq_len)
    return pallas_gpu.BlockSizes(block_q=fwd, block_k=fwd, block_q_dkv=back,
                                 block_kv_dkv=back, block_q_dq=back, block_kv_dq=back)


def pallas_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                     interpret: bool = False, scale: float | None = None) -> jax.Array:
    """jax's Pallas flash-attention kernel for GPUs (Triton), causal, with segment
    ids; ``interpret=True`` runs it on CPU (slowly: for tests). ``scale``: the
    scores' factor (None: 1 / sqrt(d))."""
    sizes = pallas_block_sizes(q.shape[1], q.shape[-1], q.dtype)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _pallas_gqa(q, k, v, segment_ids.astype(jnp.int32), sizes, interpret, scale)


def _pallas_gqa(q, k, v, segment_ids, sizes, interpret, scale):
    """The kernel wants one key/value head per query head, so the kv heads are
    repeated for it; its own VJP would keep the repeated k and v (group x theirs) for
    the backward pass. This one keeps k and v as they are and repeats them again
    there, and names the output and log-sum-exp residuals (``kernel_vjp``)."""
    forward = functools.partial(_pallas_gqa_forward, sizes=sizes, interpret=interpret,
                                scale=scale)
    backward = functools.partial(_pallas_gqa_backward, sizes=sizes, interpret=interpret,
                                 scale=scale)
    return kernel_vjp.named_residuals(forward, backward)(q, k, v, segment_ids)


def _repeat_kv(x: jax.Array, heads: int) -> jax.Array:
    return jnp.repeat(x, heads // x.shape[2], axis=2)


def _pallas_options(sizes: Any, interpret: bool, scale: float) -> dict[str, Any]:
    return dict(sm_scale=scale, causal=True, block_sizes=sizes, interpret=interpret)


def _pallas_gqa_forward(q, k, v, segment_ids, *, sizes, interpret, scale):
    from jax.experimental.pallas.ops.gpu import attention as pallas_gpu

    h = q.shape[2]
    out, lse = pallas_gpu.mha(q, _repeat_kv(k, h), _repeat_kv(v, h), segment_ids,
                              return_residuals=True, **_pallas_options(sizes, interpret, scale))
    return out, lse, None


def _pallas_gqa_backward(args, out, lse, _, d_out, *, sizes, interpret, scale):
    from jax.experimental.pallas.ops.gpu import attention as pallas_gpu

    q, k, v, segment_ids = args
    b, s, h, d = q.shape
    kv = k.shape[2]
    o = _pallas_options(sizes, interpret, scale)
    dq, dk, dv, _ = pallas_gpu._mha_backward(
        o["sm_scale"], o["causal"], o["block_sizes"], "triton", None, 2, None, interpret,
        False, False, (q, _repeat_kv(k, h), _repeat_kv(v, h), segment_ids, out, lse), d_out)
    # Each kv head's gradient: the sum over the query heads that shared it.
    dk, dv = (x.astype(jnp.float32).reshape(b, s, kv, h // kv, d).sum(3).astype(k.dtype)
              for x in (dk, dv))
    return dq, dk, dv, None


class Pallas(Kernel):
    name, what = "pallas", "Pallas (Triton) flash attention with segment ids"
    honours = ("scale",)  # jax's Pallas mha has neither a window nor a soft cap
    platforms, fused, saves, stand_in = ("gpu",), True, kernel_vjp.RESIDUALS, "tiled"

    def check_site(self, site):
        if not pallas_available():
            raise ConfigError(
                f"{_field(self.name)}: this jax ({jax.__version__}) has no Pallas Triton "
                "attention (jax.experimental.pallas.ops.gpu.attention; jax 0.12.1 removed "
                "it). Use model.attn_impl='cudnn' or 'tiled', or jax 0.12.0 or older.")
        _one_shard(self.name, site)
        sizes = pallas_block_sizes(site.seq_len, site.head_dim, site.dtype)
        if site.seq_len % sizes.block_q or site.seq_len % sizes.block_q_dq:
            raise ConfigError(
                f"{_field(self.name)} works in blocks of {sizes.block_q} tokens at head_dim "
                f"{site.head_dim}, and train.seq_len={site.seq_len} is not a multiple. Use a "
                f"multiple of {sizes.block_q}, or model.attn_impl='tiled'.")

    def __call__(self, q, k, v, segment_ids, cfg, spec=AttentionSpec(), sinks=None):
        _no_sinks(self, sinks)
        run = functools.partial(pallas_attention, interpret=platforms.current() != "gpu",
                                scale=spec.scale)
        return _per_shard(run, q, k, v, segment_ids)


def _splits(rules: Rules) -> tuple[tuple[tuple[str, ...], ...], ...]:
    """The rule table's split of q and of k, v (b, s, heads, head_dim): per dimension,
    its mesh axes."""
    return tuple(tuple(axes_of(x) for x in (tuple(rules.spec(n)) + (None,) * 4)[:4])
                 for n in (HEADS, KV_HEADS))


def _per_shard(kernel, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
               sinks: jax.Array | None = None) -> jax.Array:
    """``kernel`` on each device's rows and heads, in a shard_map manual over every
    mesh axis. A ``pallas_call`` has no rule for XLA's partitioner, which would
    otherwise gather every operand whole around it (compiled for GPUs: each device
    attending over the whole batch and all heads); nor do the tiled and blocked
    kernels' conditionals (their skipped tiles and key ranges), inside which it
    gathered the operands. Batch and heads split as the rule table says; each
    device's query heads share its kv heads (the model repeats kv heads so that they
    do: Rules.kv_repeat). ``sinks`` (heads,), where given, split like the heads: each
    device gets its own heads' (their gradient, the sum over the devices' rows)."""
    # The kernel gets sinks (by keyword) only where there are: a sink-free call unchanged.
    with_sinks = () if sinks is None else (sinks,)
    run = kernel if sinks is None else (
        lambda q, k, v, segment_ids, sinks: kernel(q, k, v, segment_ids, sinks=sinks))
    rules = active()
    if rules is None or rules.mesh is None or rules.mesh.size == 1:
        return run(q, k, v, segment_ids, *with_sinks)
    q_axes, kv_axes = _splits(rules)
    if q_axes[1] or q_axes[3] or kv_axes != q_axes:
        # The sequence split, or kv heads split unlike the query heads: left to the
        # partitioner (correct, with the gathers above).
        return run(q, k, v, segment_ids, *with_sinks)
    spec = rules.spec(HEADS)  # k's and v's too (kv_axes == q_axes)
    rows = PartitionSpec(spec[0] if len(spec) else None, None)
    heads = PartitionSpec(spec[2] if len(spec) > 2 else None)

    def local(q, k, v, segment_ids, *sinks):
        with suspended():  # one device's arrays: no rules apply inside
            return run(q, k, v, segment_ids, *sinks)

    in_specs = (spec, spec, spec, rows) + (heads,) * len(with_sinks)
    shard = functools.partial(jax.shard_map, mesh=rules.mesh, check_vma=False)
    if mesh_lib.stages(rules.mesh) > 1:
        return _per_shard_in_stages(local, shard, in_specs, spec)(q, k, v, segment_ids,
                                                                 *with_sinks)
    return shard(local, in_specs=in_specs, out_specs=spec)(q, k, v, segment_ids, *with_sinks)


def _per_shard_in_stages(local, shard, in_specs, out_spec):
    """``_per_shard``'s shard_map inside pipeline stages, which vmap it over ``stage``:
    jax differentiating a shard_map manual over every axis gives its residuals a spec
    over all of them, ``stage`` included, which the vmap over ``stage`` cannot take. So
    the gradient is a shard_map of its own that recomputes the kernel's forward (one
    more attention forward per layer in the backward pass)."""
    @jax.custom_vjp
    def attend(*args):
        return shard(local, in_specs=in_specs, out_specs=out_spec)(*args)

    def forward(*args):
        return attend(*args), args

    def backward(args, g):
        def local_grads(g, *args):
            _, vjp = jax.vjp(lambda *a: local(*a[:3], args[3], *a[3:]),
                             *args[:3], *args[4:])
            return vjp(g)
        rest = in_specs[:3] + in_specs[4:]
        grads = shard(local_grads, in_specs=(out_spec, *in_specs), out_specs=rest)(g, *args)
        segment_ids = np.zeros(args[3].shape, jax.dtypes.float0)
        return (*grads[:3], segment_ids, *grads[3:])

    attend.defvjp(forward, backward)
    return attend


KERNELS: dict[str, Kernel] = {kernel.name: kernel for kernel in
                              (Dense(), Blocked(), Tiled(), Ring(), Cudnn(), Pallas())}
IMPLS = ("auto", *KERNELS)


def stand_in(impl: str) -> str:
    """What a compile on devices ``impl`` does not run on compiles instead
    (``Kernel.stand_in``); ``impl`` itself where it has none (or is auto)."""
    kernel = KERNELS.get(impl)
    return kernel.stand_in if kernel is not None and kernel.stand_in else impl


# ----- the choice ----------------------------------------------------------------------------


CP_IMPLS = ("auto", "ring", "all_to_all")


@dataclasses.dataclass(frozen=True)
class Choice:
    name: str      # a key of KERNELS: what computes the attention
    why: str       # one clause for the start-up line
    # How context shards meet where the sequence is split: "ring" (then ``name`` is
    # "ring") or "all_to_all" (``name`` runs on each device's slice of the heads).
    cp: str | None = None

    @property
    def label(self) -> str:
        return f"all_to_all+{self.name}" if self.cp == "all_to_all" else self.name

    def describe(self) -> str:
        if self.cp == "all_to_all":
            return (f"all_to_all (sequence shards to head shards and back, then "
                    f"{self.name}: {KERNELS[self.name].what}; {self.why})")
        return f"{self.name} ({KERNELS[self.name].what}; {self.why})"


def _choose_one_shard(impl: str, site: Site) -> Choice:
    if impl != "auto":
        KERNELS[impl].check(site)
        return Choice(impl, f"model.attn_impl={impl}")
    refused = []
    if site.platform == "gpu":
        for name in (n for n, k in KERNELS.items() if k.fused and site.platform in k.platforms):
            try:
                KERNELS[name].check(site)
            except ConfigError as e:
                refused.append(f"{name}: {str(e).split(': ', 1)[-1]}")
                continue
            return Choice(name, "auto on GPU" + (f" ({refused[0]})" if refused else ""))
    why = "auto on " + site.platform.upper()
    if refused:
        why += f"; fused kernels refused ({' / '.join(refused)})"
    if site.seq_len <= DENSE_MAX_SEQ:
        return Choice("dense", f"{why}, seq_len {site.seq_len} <= {DENSE_MAX_SEQ}")
    if site.seq_len <= BLOCKED_MAX_SEQ:
        return Choice("blocked", f"{why}, {DENSE_MAX_SEQ} < seq_len {site.seq_len} <= "
                                 f"{BLOCKED_MAX_SEQ}")
    try:
        KERNELS["tiled"].check(site)
        return Choice("tiled", f"{why}, seq_len {site.seq_len} > {BLOCKED_MAX_SEQ}")
    except ConfigError as e:
        return Choice("blocked", f"{why}; tiled refused: {e}")


def _check_all_to_all(site: Site) -> None:
    heads = site.heads_per_shard
    if heads % site.context:
        raise ConfigError(
            f"model.cp_impl='all_to_all' gives each of mesh.context={site.context} shards a "
            f"slice of the query heads, and each device holds {heads} (model.n_heads="
            f"{site.n_heads} over {site.head_shards} tensor shards), which do not split "
            f"{site.context} ways. Use a mesh.context dividing {heads}, fewer tensor shards, "
            "or model.cp_impl='ring'.")


def _all_to_all(impl: str, site: Site, why: str) -> Choice:
    if impl == "ring":
        raise ConfigError(
            "model.attn_impl='ring' is the ring algorithm of context parallelism, and "
            "model.cp_impl='all_to_all' is the other one. Use model.attn_impl='auto' or a "
            "one-shard kernel (dense, blocked, tiled, cudnn, pallas) with all_to_all, or "
            "model.cp_impl='ring'.")
    _check_all_to_all(site)
    inner = _choose_one_shard(impl, site.one_shard())
    return Choice(inner.name, f"{why}; {inner.why} over the whole sequence", "all_to_all")


def _choose_context(impl: str, site: Site) -> Choice:
    """The sequence is split over mesh.context: ring attention, or all-to-all around a
    one-shard kernel (``model.cp_impl``). auto: all-to-all where the heads split and
    a fused kernel runs inside (GPUs), else ring, whose tiles are what all-to-all
    would run here anyway, with fewer bytes moved (k and v, not q, k, v and the
    output). A kernel named in ``model.attn_impl`` runs inside all-to-all; ``dense``
    also runs unsplit (the partitioner gathering the sequence for it)."""
    c, cp = site.context, site.cp_impl
    split = f"the sequence is split over mesh.context={c}"
    if cp == "all_to_all":
        return _all_to_all(impl, site, f"{split}, model.cp_impl=all_to_all")
    if impl in ("auto", "ring") and cp == "ring" or impl == "ring":
        KERNELS["ring"].check(site)
        return Choice("ring", f"{split}, model.{'cp' if cp == 'ring' else 'attn'}_impl=ring",
                      "ring")
    if cp == "ring":  # a one-shard kernel by name, and no all-to-all
        KERNELS[impl].check(site)  # refuses, but for dense
        return Choice(impl, f"model.attn_impl={impl}, the partitioner gathering the sequence")
    try:
        _check_all_to_all(site)
        inner = _choose_one_shard(impl, site.one_shard())
    except ConfigError as e:
        if impl == "auto":
            KERNELS["ring"].check(site)
            return Choice("ring", f"{split}; all_to_all refused: {e}", "ring")
        try:
            KERNELS[impl].check(site)
        except ConfigError:
            raise e from None  # what keeps it from running inside all_to_all
        return Choice(impl, f"model.attn_impl={impl}, the partitioner gathering the sequence "
                            f"(all_to_all refused: {e})")
    if impl == "auto" and not KERNELS[inner.name].fused:
        try:
            KERNELS["ring"].check(site)
            return Choice("ring", f"{split}, auto: no fused kernel here for all_to_all to run",
                          "ring")
        except ConfigError as e:  # e.g. a soft cap: only the one-shard kernels have it
            return Choice(inner.name, f"{split}, auto; ring refused ({e}); {inner.why} over "
                                      "the whole sequence", "all_to_all")
    return Choice(inner.name, f"{split}, {'auto; ' if impl == 'auto' else ''}{inner.why} "
                              "over the whole sequence", "all_to_all")


def choose(impl: str, site: Site) -> Choice:
    """The kernel that runs for ``model.attn_impl=impl`` (and ``site.cp_impl``);
    ConfigError where an explicit choice cannot run there."""
    if impl not in IMPLS:
        raise ConfigError(f"model.attn_impl={impl!r}: choose one of {IMPLS} (auto picks by "
                          "mesh, device and sequence length).")
    if site.cp_impl not in CP_IMPLS:
        raise ConfigError(f"model.cp_impl={site.cp_impl!r}: choose one of {CP_IMPLS}.")
    if site.context > 1:
        return _choose_context(impl, site)
    return _choose_one_shard(impl, site)


@functools.cache
def _chosen_at_trace(impl: str, site: Site) -> Choice:
    return choose(impl, site)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
              cfg: Any, spec: AttentionSpec = AttentionSpec(),
              sinks: jax.Array | None = None) -> jax.Array:
    """Attention with ``cfg.attn_impl``: a kernel name (``Experiment`` resolves
    ``auto`` up front, and ``cfg.cp_impl`` to ring or all_to_all), or ``auto``,
    chosen here from the shapes and active rules (a model built outside an
    Experiment, e.g. in tests). ``spec``: the layer's; a kernel chosen without it in
    ``cfg.attention_specs`` that cannot compute it is refused here (ConfigError),
    never run without it. ``sinks``: the layer's sink logits (n_heads,), any float
    dtype (computed in float32), given exactly where ``spec.sinks``."""
    if (sinks is not None) != spec.sinks:
        raise ValueError(f"attention: spec.sinks={spec.sinks} and sinks "
                         f"{'given' if sinks is not None else 'None'}: give sink logits "
                         "exactly where the spec has sinks")
    if sinks is not None and sinks.shape != (q.shape[2],):
        raise ValueError(f"attention: sinks of shape {sinks.shape}, and q has {q.shape[2]} "
                         "heads: one sink logit per query head")
    rules = active()
    name, cp = cfg.attn_impl, getattr(cfg, "cp_impl", "auto")
    if name == "auto" or cp == "auto":
        choice = _chosen_at_trace(name, Site.of(cfg, q.shape[1], rules, q.shape[0]))
        name, cp = choice.name, choice.cp
    KERNELS[name].check_spec(spec.at(q.shape[1]))
    if cp == "all_to_all" and ring.context_shards(rules) > 1:
        def kernel(q, k, v, segment_ids, sinks=None):
            return KERNELS[name](q, k, v, segment_ids, cfg, spec, sinks)
        return a2a.all_to_all_attention(kernel, q, k, v, segment_ids, rules, HEADS, KV_HEADS,
                                        sinks)
    return KERNELS[name](q, k, v, segment_ids, cfg, spec, sinks)
