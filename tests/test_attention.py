"""Every attention kernel equals ``dense`` (forward and gradients); ``auto`` picks
as documented; an explicit kernel that cannot run is a ConfigError.

Tolerance: max abs diff <= 2e-5 in float32 for outputs and gradients of order 1.
The kernels sum the same softmax in a different order (online, tile by tile),
which moves results by a few ulps. The Pallas kernel runs in interpret mode on
CPU: the same program a GPU compiles with Triton, executed by XLA.
"""

import dataclasses
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from helpers import assert_same_training
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jcore

from ndjax.experiment import Experiment
from ndjax.hardware import roofline
from ndjax.models import decoder
from ndjax.ops import attention as attn
from ndjax.ops import kernel_vjp
from ndjax.runtime import compiler
from ndjax.runtime.errors import ConfigError

ATOL = 2e-5
# (heads, kv heads): multi-head, grouped-query, multi-query.
HEADS = [(4, 4), (4, 2), (4, 1)]



# jax 0.12.1 removed Pallas's Triton attention: there the kernel is refused
# (test_pallas_is_refused_where_this_jax_lacks_it), and the tests that run or choose it
# run on the jax that has it (.ci/run's first leg, jax 0.10.2).
needs_pallas = pytest.mark.skipif(not attn.pallas_available(),
                                  reason="this jax has no Pallas Triton attention")

def _inputs(b, s, h, kv, d, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, s, h, d))
    k = jax.random.normal(ks[1], (b, s, kv, d))
    v = jax.random.normal(ks[2], (b, s, kv, d))
    # Row 0: three documents then padding (id 0); row 1: one document.
    seg = np.zeros((b, s), np.int32)
    seg[0, :20], seg[0, 20:45], seg[0, 45:s - 5] = 1, 2, 3
    seg[1:] = 1
    dout = jax.random.normal(ks[3], (b, s, h, d))
    return q, k, v, jnp.asarray(seg), dout


def _output_and_grads(fn, q, k, v, seg, dout):
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, seg), q, k, v)
    return (out, *vjp(dout))


def _short_documents(b, s, longest, seed=0):
    """Rows of documents of 1 .. longest tokens (random lengths), no padding."""
    ends = np.cumsum(np.random.default_rng(seed).integers(1, longest + 1, (b, s)), axis=1)
    return np.stack([np.searchsorted(e, np.arange(s), side="right") for e in ends]).astype(
        np.int32)


def _assert_matches_dense(fn, heads, kv_heads, s=64, d=16, spec=None, seg=None, b=2):
    spec = spec or attn.AttentionSpec()
    args = _inputs(b, s, heads, kv_heads, d)
    if seg is not None:
        args = (*args[:3], jnp.asarray(seg), args[4])
    got = jax.jit(lambda *a: _output_and_grads(fn, *a))(*args)
    want = jax.jit(lambda *a: _output_and_grads(
        lambda q, k, v, seg: attn.dense(q, k, v, seg, spec), *a))(*args)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, w, atol=ATOL, err_msg=name)


@pytest.mark.parametrize("heads, kv_heads", HEADS)
def test_tiled_matches_dense(heads, kv_heads):
    cfg = dataclasses.make_dataclass("C", [("attn_kv_tile", int)])(16)
    _assert_matches_dense(lambda q, k, v, seg: attn.KERNELS["tiled"](q, k, v, seg, cfg),
                          heads, kv_heads)


@pytest.mark.parametrize("heads, kv_heads", HEADS)
@pytest.mark.parametrize("s", [64, 60])  # 8 query blocks of 8; 6 of 10 (8 does not divide 60)
def test_blocked_matches_dense(heads, kv_heads, s):
    assert attn.query_blocks(s) == {64: 8, 60: 6}[s]
    _assert_matches_dense(lambda q, k, v, seg: attn.KERNELS["blocked"](q, k, v, seg, None),
                          heads, kv_heads, s=s)


def _picked_by_hand(seg, blocks, window):
    """Per query block, the first of its ``key_ranges`` whose keys left out hold no
    segment id within the block's queries' range in any row (the last: none left out)."""
    size = seg.shape[1] // blocks
    picked = []
    for i, starts in enumerate(attn.key_ranges(seg.shape[1], blocks, window)):
        queries = seg[:, i * size:(i + 1) * size]
        for n, start in enumerate(starts):
            left_out = seg[:, starts[-1]:start]
            if all(x.size == 0 or max(r.min(), x.min()) > min(r.max(), x.max())
                   for r, x in zip(queries, left_out)):
                picked.append(n)
                break
    return picked


@pytest.mark.parametrize("spec", [attn.AttentionSpec(),
                                  attn.AttentionSpec(window=20, scale=0.2)], ids=str)
def test_blocked_skips_the_keys_of_other_documents(spec):
    """8 query blocks of 8 tokens, rows of documents of at most 8 tokens: from block 2 on
    each block computes its own and the previous block's keys (16, not 8 x (i + 1) or
    the window's 27), as counted by hand; outputs and gradients are dense's. One
    document per row: every block computes its full range."""
    window = attn._window(spec, 64)
    seg = _short_documents(2, 64, 8)
    ranges = attn.key_ranges(64, 8, window)
    pick = jax.jit(attn.picked_key_ranges, static_argnums=(1, 2))
    for rows, want in ((seg, [0] * 8), (np.ones_like(seg), [len(r) - 1 for r in ranges])):
        picked = np.asarray(pick(rows, 8, window)).tolist()
        assert picked == want == _picked_by_hand(rows, 8, window)
    assert [len(r) for r in ranges] == [1, 1] + [2] * 6
    keys = [(i + 1) * 8 - r[0] for i, r in enumerate(ranges)]
    assert keys == [8] + [16] * 7
    _assert_matches_dense(lambda *a: attn.blocked(*a, 8, spec), 4, 2, spec=spec, seg=seg)


@pytest.mark.parametrize("impl, mesh", [("tiled", dict(fsdp=4, tensor=2)),
                                        ("blocked", dict(fsdp=4, tensor=2)),
                                        ("ring", dict(fsdp=2, context=2, tensor=2))])
def test_skipping_kernels_on_each_devices_rows_and_heads(impl, mesh):
    """Under the default rule table each device attends on its own rows and heads (a
    shard_map manual over every mesh axis), skipping by its own rows' documents:
    outputs and gradients are dense's."""
    from ndjax.ops import ring_attention as ra
    from ndjax.parallel.mesh import ParallelDims, build_mesh
    from ndjax.parallel.rules import Rules, use

    b, s = 4, 64
    seg = _short_documents(b, s, 10)
    seg[1] = 1  # one row of one document
    cfg = types.SimpleNamespace(attn_kv_tile=8, cp_layout="zigzag")
    perm = ra.layout_permutation("zigzag", s, mesh.get("context", 1))
    undo = np.argsort(perm)

    def kernel(q, k, v, seg):  # in the natural order, as dense's
        return attn.KERNELS[impl](*(x[:, perm] for x in (q, k, v, seg)), cfg)[:, undo]

    with use(Rules("default", build_mesh(ParallelDims(**mesh)))):
        _assert_matches_dense(kernel, 4, 2, seg=seg, b=b)


@needs_pallas
@pytest.mark.parametrize("heads, kv_heads", HEADS)
def test_pallas_matches_dense(heads, kv_heads):
    _assert_matches_dense(lambda *a: attn.pallas_attention(*a, interpret=True), heads,
                          kv_heads)


def _cudnn_semantics(q, k, v, lengths, offsets, *, scale, window):
    """What jax's cuDNN attention computes for packed rows (PADDING_CAUSAL with
    sequence offsets), written plainly: each (offset, length) is a sequence, causal
    inside it, a token at pos seeing (pos - sliding_window_length, pos] of it (jax's
    docstring; cuDNN's diagonal band with left bound = the window). Tokens outside
    every sequence get no output (zeros). Returns (output, softmax statistics), as
    jax's does with return_residual; the statistics here are placeholders of their
    shape, (b x runs, heads, s), which only the cuDNN backward would read."""
    b, s, h, _ = q.shape
    t = jnp.arange(s)
    starts, lengths = offsets[:, :-1, None], lengths[:, :, None]
    inside = (starts >= 0) & (t >= starts) & (t < starts + lengths)   # (b, runs, s)
    run = jnp.where(inside.any(1), jnp.argmax(inside, axis=1) + 1, 0)
    spec = attn.AttentionSpec(window=window, scale=scale)
    out = attn.dense(q, k, v, run, spec) * inside.any(1)[:, :, None, None]
    return out, jnp.zeros((b * lengths.shape[1], h, s), jnp.float32)


# The cudnn kernel's bound on documents per row (model.attn_max_docs): room for
# more runs than any test row holds, and fewer than its tokens.
CUDNN_CFG = types.SimpleNamespace(attn_max_docs=12)


def test_segment_runs_are_cudnn_sequences():
    seg = jnp.array([[1, 1, 2, 2, 2, 0], [5, 5, 5, 5, 5, 5], [1, 2, 1, 2, 3, 3]], jnp.int32)
    # Room for 5 runs (the most a row here holds), not one per token: cuDNN sizes
    # its saved softmax statistics by it.
    lengths, offsets = attn.segment_runs(seg, 5)
    np.testing.assert_array_equal(lengths, [[2, 3, 1, -1, -1], [6, -1, -1, -1, -1],
                                            [1, 1, 1, 1, 2]])
    np.testing.assert_array_equal(offsets, [[0, 2, 5, 6, -1, -1], [0, 6, -1, -1, -1, -1],
                                            [0, 1, 2, 3, 4, 6]])
    np.testing.assert_array_equal(attn.runs_per_row(np.asarray(seg)), [3, 1, 5])


def test_cudnn_refuses_a_batch_with_more_documents_than_its_bound():
    kernel = attn.KERNELS["cudnn"]
    seg = np.array([[1, 1, 2, 2, 2, 0], [1, 2, 1, 2, 3, 3]], np.int32)
    kernel.check_batch(seg, types.SimpleNamespace(attn_max_docs=5))
    with pytest.raises(ConfigError, match=r"model.attn_max_docs=4: a batch row holds 5 "):
        kernel.check_batch(seg, types.SimpleNamespace(attn_max_docs=4))


def test_only_cudnn_bounds_the_runs_a_row_may_hold():
    """What make_loader packs rows within (Experiment.max_runs): cuDNN's room, else none."""
    cfg = types.SimpleNamespace(attn_max_docs=5)
    assert {n: k.max_runs(cfg) for n, k in attn.KERNELS.items() if k.max_runs(cfg)} == {
        "cudnn": 5}


@pytest.mark.parametrize("heads, kv_heads", HEADS)
def test_ndjax_side_of_cudnn_matches_dense_with_cudnn_replaced_by_its_semantics(
        heads, kv_heads, monkeypatch):
    """Checks ndjax's side of the cudnn kernel (segment ids -> ragged sequences, the
    residuals' names, the VJP wiring) with cuDNN itself (``_cudnn_packed``) replaced by
    a plain statement of its packed-row semantics: no CPU can run cuDNN. What cuDNN
    computes is unchecked until a GPU runs it (bench/gpu.py's first case)."""
    monkeypatch.setattr(attn, "_cudnn_packed", _cudnn_semantics)
    _assert_matches_dense(lambda q, k, v, seg: attn.KERNELS["cudnn"](q, k, v, seg, CUDNN_CFG),
                          heads, kv_heads)


def _site(**kw):
    base = dict(seq_len=4096, n_heads=32, n_kv_heads=8, head_dim=64, dtype=jnp.bfloat16,
                context=1, platform="gpu", layout="zigzag", kv_tile=512,
                compute_capability="9.0")
    return attn.Site(**{**base, **kw})


@needs_pallas
def test_auto_choices():
    assert attn.choose("auto", _site()).name == "cudnn"
    f32 = attn.choose("auto", _site(dtype=jnp.float32))
    assert f32.name == "pallas" and "needs bfloat16 or float16" in f32.why, f32
    assert attn.choose("auto", _site(compute_capability="8.0")).name == "pallas"
    # Under context parallelism on a GPU: cuDNN inside all-to-all where the heads split
    # (32 over 4 shards), else the ring (32 heads on 8 tensor shards: 4, over 8), or
    # where asked.
    a2a = attn.choose("auto", _site(context=4))
    assert (a2a.name, a2a.cp) == ("cudnn", "all_to_all") and "over the whole" in a2a.why, a2a
    ring = attn.choose("auto", _site(context=8, head_shards=8))
    assert (ring.name, ring.cp) == ("ring", "ring") and "all_to_all refused" in ring.why, ring
    assert attn.choose("auto", _site(context=4, cp_impl="ring")).name == "ring"
    cpu_cp = attn.choose("auto", _site(context=4, platform="cpu", compute_capability=None))
    assert cpu_cp.name == "ring" and "no fused kernel" in cpu_cp.why, cpu_cp
    # One row per micro-batch on several GPUs: jax's cuDNN sharding rule fails to
    # verify (tests/test_gpu_compile.py compiles both cases).
    assert attn.choose("auto", _site(rows=1, devices=2)).name == "pallas"
    assert attn.choose("auto", _site(rows=1, devices=1)).name == "cudnn"
    odd = attn.choose("auto", _site(dtype=jnp.float32, seq_len=4000, kv_tile=500))
    assert odd.name == "tiled" and "pallas" in odd.why, odd
    cpu = dict(platform="cpu", compute_capability=None, dtype=jnp.float32)
    assert attn.choose("auto", _site(**cpu)).name == "tiled"
    assert attn.choose("auto", _site(**cpu, seq_len=128)).name == "dense"
    assert attn.choose("auto", _site(**cpu, seq_len=256)).name == "dense"
    assert attn.choose("auto", _site(**cpu, seq_len=512)).name == "blocked"
    assert attn.choose("auto", _site(**cpu, seq_len=1024)).name == "blocked"
    assert attn.choose("auto", _site(**cpu, seq_len=2048)).name == "tiled"
    assert attn.choose("auto", _site(**cpu, seq_len=4100)).name == "blocked"  # 512 ∤ 2050
    assert attn.choose("auto", _site(**cpu, seq_len=4100, kv_tile=410)).name == "tiled"
    assert attn.choose("auto", _site(**cpu, seq_len=4099, kv_tile=1)).name == "blocked"  # odd
    assert attn.choose("blocked", _site(**cpu, seq_len=4099)).name == "blocked"
    assert "auto on CPU" in attn.choose("auto", _site(**cpu)).describe()


@pytest.mark.parametrize("impl, site, match", [
    ("cudnn", dict(head_dim=100), r"head_dim that is a multiple of 8 and at most 256 .* 100"),
    ("cudnn", dict(dtype=jnp.float32), r"needs bfloat16 or float16 compute"),
    ("cudnn", dict(compute_capability="8.0", head_dim=256), r"at most 128 on this GPU"),
    ("cudnn", dict(context=2, cp_impl="ring"), r"runs on one context shard.*cp_impl='all_to_all'"),
    pytest.param("pallas", dict(seq_len=4000),
                 r"blocks of 128 tokens at head_dim 64, and train.seq_len=4000",
                 marks=needs_pallas),
    ("pallas", dict(platform="cpu"), r"runs on NVIDIA GPUs, and this run's devices are cpu"),
    ("dense", dict(context=2, cp_impl="ring"), None),
    ("blocked", dict(context=2, cp_impl="ring"), r"runs on one context shard"),
    # Under context parallelism a one-shard kernel runs inside all_to_all (cp_impl auto)
    # where each device's heads split over the context shards.
    ("cudnn", dict(context=2), None),
    ("blocked", dict(context=2, platform="cpu"), None),
    ("tiled", dict(context=8, head_shards=8), r"each device holds 4 \(model.n_heads=32 over 8"),
])
def test_explicit_kernel_checks(impl, site, match):
    if match is None:
        choice = attn.choose(impl, _site(**site))
        assert choice.name == impl
        assert choice.cp == ("all_to_all" if site.get("cp_impl") != "ring" and
                             site.get("context", 1) > 1 else None), choice
        return
    with pytest.raises(ConfigError, match=match) as e:
        attn.choose(impl, _site(**site))
    assert "\n" not in str(e.value)


# ----- per-layer specs: sliding windows, soft caps, scales ----------------------------------

Spec = attn.AttentionSpec
# Windows shorter than the 64-token test rows, none a divisor of the kernels' 8-token
# tiles and blocks: within one tile (5), across two (12), across three, with a scale.
WINDOWS = [Spec(window=5), Spec(window=12), Spec(window=20, scale=0.2)]
KERNEL_CFG = types.SimpleNamespace(attn_kv_tile=8, attn_max_docs=12)


def _numpy_attention(q, k, v, seg, spec):
    """``spec``'s attention written plainly, one query at a time in float64: the keys
    of the query's document at p - window < k <= p (Hugging Face's sliding_window),
    scores times the scale, soft-capped, softmax."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    seg = np.asarray(seg)
    b, s, h, d = q.shape
    group = h // k.shape[2]
    out = np.zeros_like(q)
    keys = np.arange(s)
    for i, p in np.ndindex(b, s):
        seen = (keys <= p) & (seg[i] == seg[i, p])
        if spec.window is not None:
            seen &= keys > p - spec.window
        # Query head j reads kv head j // group, as the kernels group them.
        scores = np.einsum("thd,hd->ht", k[i, seen].repeat(group, axis=1), q[i, p])
        scores = scores * spec.scale_for(d)
        if spec.softcap is not None:
            scores = spec.softcap * np.tanh(scores / spec.softcap)
        w = np.exp(scores - scores.max(-1, keepdims=True))
        out[i, p] = np.einsum("ht,thd->hd", w / w.sum(-1, keepdims=True),
                              v[i, seen].repeat(group, axis=1))
    return out


@pytest.mark.parametrize("spec", [Spec(), Spec(window=1), Spec(window=12),
                                  Spec(window=5, softcap=2.0, scale=0.5)], ids=str)
def test_dense_computes_the_spec(spec):
    """dense, the reference every kernel is held to, against the spec written plainly."""
    q, k, v, seg, _ = _inputs(2, 64, 4, 2, 16)
    got = jax.jit(lambda *a: attn.dense(*a, spec))(q, k, v, seg)
    np.testing.assert_allclose(got, _numpy_attention(q, k, v, seg, spec), atol=ATOL)


@pytest.mark.parametrize("impl, spec", [
    *(("cudnn", spec) for spec in [*WINDOWS, Spec(scale=0.3)]),
    # tiled: more windows and both layouts in tests/test_ring_attention.py.
    *(("tiled", spec) for spec in WINDOWS[1:]),
    # blocked: window 5 takes its chunks; its query blocks in the test below.
    ("blocked", WINDOWS[0]),
], ids=lambda p: "cudnn_replaced_by_its_semantics" if p == "cudnn" else str(p))
def test_kernels_compute_the_spec_like_dense(impl, spec, monkeypatch):
    """Outputs and gradients on packed rows. For cudnn only ndjax's side (the window
    and scale it passes) is checked: cuDNN itself is replaced by its stated semantics
    (``_cudnn_semantics``), and its numbers are unchecked until a GPU runs bench/gpu.py."""
    monkeypatch.setattr(attn, "_cudnn_packed", _cudnn_semantics)
    _assert_matches_dense(lambda q, k, v, seg: attn.KERNELS[impl](q, k, v, seg, KERNEL_CFG, spec),
                          4, 2, spec=spec)


def test_blocked_query_blocks_compute_the_spec_like_dense():
    """4 query blocks of 15 tokens, each from the first key its window reaches, with a
    soft cap and a scale."""
    spec = Spec(window=12, softcap=3.0, scale=0.3)
    assert attn._chunks_work(60, 12) > attn._blocks_work(60, 4, 12)  # not the chunks
    _assert_matches_dense(lambda q, k, v, seg: attn.blocked(q, k, v, seg, 4, spec), 4, 2, s=60,
                          spec=spec)


@pytest.mark.parametrize("window", [1, 7])  # 60 tokens: 60 chunks; 9, the last padded
def test_window_chunks_match_dense(window):
    """blocked's O(seq x window) form, whatever the chunks' padding."""
    spec = Spec(window=window, softcap=3.0)
    _assert_matches_dense(lambda q, k, v, seg: attn.window_chunks(q, k, v, seg, window, spec),
                          4, 2, s=60, spec=spec)


def test_blocked_takes_the_chunks_where_they_do_less_work():
    assert attn._chunks_work(64, 5) < attn._blocks_work(64, 8, 5)      # chunks
    assert attn._chunks_work(64, 12) > attn._blocks_work(64, 8, 12)    # query blocks
    assert attn._chunks_work(4096, 64) == 2 * 4096 * 64   # O(seq x window)


def test_windowed_blocked_memory_is_linear_in_the_sequence():
    """Forward and backward's compiled temporaries, window 16: 4x the tokens may cost at
    most 5x (the scores of blocked without a window grow 16x)."""
    spec = Spec(window=16)

    def temp(s):
        q = jax.ShapeDtypeStruct((1, s, 2, 8), jnp.float32)
        kv = jax.ShapeDtypeStruct((1, s, 1, 8), jnp.float32)
        seg = jax.ShapeDtypeStruct((1, s), jnp.int32)
        step = jax.jit(lambda q, k, v, seg, dout: _output_and_grads(
            lambda *a: attn.blocked(*a, attn.query_blocks(s), spec), q, k, v, seg, dout))
        return step.lower(q, kv, kv, seg, q).compile().memory_analysis().temp_size_in_bytes

    small, large = temp(1024), temp(4096)
    assert large <= 5 * small, (small, large)
    assert large < 4096 * 4096 * 2 * 4 / 16, large  # a 16th of one (seq x seq) score matrix


@needs_pallas
def test_pallas_computes_the_scale():
    spec = Spec(scale=0.3)
    _assert_matches_dense(lambda *a: attn.pallas_attention(*a, interpret=True, scale=0.3),
                          4, 2, spec=spec)


CPU = dict(platform="cpu", compute_capability=None, dtype=jnp.float32)


@pytest.mark.parametrize("impl, site, spec, match", [
    pytest.param("pallas", {}, Spec(window=1024),
                 r"^model.attn_impl='pallas' has no sliding window, and the model's attention "
                 r"sets window=1024 \(AttentionSpec\). Use model.attn_impl='auto', 'dense', "
                 r"'blocked', 'tiled' or 'cudnn'\.$", marks=needs_pallas),
    pytest.param("pallas", {}, Spec(softcap=50.0),
                 r"has no logit soft cap, .* sets softcap=50.0 .*Use model.attn_impl='auto', "
                 r"'dense' or 'blocked'\.$", marks=needs_pallas),
    ("tiled", CPU, Spec(window=8, softcap=50.0), r"^model.attn_impl='tiled' has no logit soft "
                                                 r"cap, .* softcap=50.0"),
    ("ring", dict(context=4), Spec(softcap=50.0),
     r"^model.attn_impl='ring' has no logit soft cap, .* Use model.cp_impl='all_to_all' "
     r"\(or mesh.context=1\) and "
     r"model.attn_impl='auto', 'dense' or 'blocked'\.$"),
    ("cudnn", {}, Spec(softcap=30.0), r"^model.attn_impl='cudnn' has no logit soft cap"),
    ("dense", {}, Spec(causal=False), r"computes causal attention, .* causal=False"),
    ("blocked", CPU, Spec(window=0), r"window=0 .* Use window >= 1"),
])
def test_kernels_refuse_specs_they_do_not_compute(impl, site, spec, match):
    with pytest.raises(ConfigError, match=match) as e:
        attn.choose(impl, _site(**site, specs=(Spec(), spec)))
    assert "\n" not in str(e.value)


@needs_pallas
def test_auto_takes_only_kernels_that_compute_every_spec():
    windowed = (Spec(), Spec(window=1024))
    capped = (Spec(window=1024, softcap=50.0), Spec(softcap=50.0))
    assert attn.choose("auto", _site(specs=windowed)).name == "cudnn"
    f32 = attn.choose("auto", _site(dtype=jnp.float32, specs=windowed))
    assert f32.name == "tiled" and "pallas: " in f32.why and "sliding window" in f32.why, f32
    assert attn.choose("auto", _site(specs=capped)).name == "blocked"   # tiled refused too
    assert attn.choose("auto", _site(**CPU, seq_len=2048, specs=windowed)).name == "tiled"
    assert attn.choose("auto", _site(**CPU, seq_len=2048, specs=capped)).name == "blocked"
    # Context parallelism: cuDNN's window inside all-to-all; a soft cap, which neither a
    # fused kernel nor the ring computes, in blocked inside all-to-all; the ring alone
    # (heads that do not split) refuses it, naming the fix.
    assert attn.choose("auto", _site(context=4, specs=windowed)).label == "all_to_all+cudnn"
    assert attn.choose("auto", _site(**CPU, context=4, specs=windowed)).name == "ring"
    assert attn.choose("auto", _site(context=4, specs=capped)).label == "all_to_all+blocked"
    with pytest.raises(ConfigError, match=r"Use model.cp_impl='all_to_all' \(or mesh.context=1"):
        attn.choose("auto", _site(context=4, cp_impl="ring", specs=capped))


def test_pallas_is_refused_where_this_jax_lacks_it(monkeypatch):
    """Where jax has no Pallas Triton attention (0.12.1 removed it), asking for it is
    one line naming the fix, and auto picks another kernel."""
    monkeypatch.setattr(attn, "pallas_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^model.attn_impl='pallas': this jax \(.*\) has no "
                                          r"Pallas Triton attention .* Use model.attn_impl="
                                          r"'cudnn' or 'tiled', or jax 0.12.0 or older\.$"):
        attn.choose("pallas", _site())
    f32 = attn.choose("auto", _site(dtype=jnp.float32))
    assert f32.name == "tiled" and "has no Pallas Triton attention" in f32.why, f32
    assert attn.choose("auto", _site()).name == "cudnn"


@needs_pallas
def test_a_window_that_hides_no_key_rules_out_no_kernel():
    """Mistral's window of 4096 at seq_len 4096 hides no key: the fused kernel
    without a window (pallas in float32) computes it, by auto and by name; one
    token shorter than the row, the window is real and pallas is refused."""
    whole = (Spec(window=4096),)
    f32 = dict(dtype=jnp.float32, specs=whole)
    assert attn.choose("auto", _site(**f32)).name == "pallas"
    assert attn.choose("pallas", _site(**f32)).name == "pallas"
    with pytest.raises(ConfigError, match=r"no sliding window, and the model's attention sets "
                                          r"window=4095"):
        attn.choose("pallas", _site(dtype=jnp.float32, specs=(Spec(window=4095),)))


def _forward_work(jaxpr, stack: str = "") -> int:
    """The fused kernels' forward work in ``jaxpr``: the ``pallas_call`` and
    ``dot_general`` equations inside ``kernel_vjp``'s forward scope, sub-jaxprs
    included (a Pallas kernel's body not: its call counts once)."""
    n = 0
    for eqn in jaxpr.eqns:
        where = f"{stack}/{eqn.source_info.name_stack}"
        if kernel_vjp.FORWARD_SCOPE in where and eqn.primitive.name in ("dot_general",
                                                                        "pallas_call"):
            n += 1
        if eqn.primitive.name == "pallas_call":
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(sub, (jcore.Jaxpr, jcore.ClosedJaxpr)):
                    n += _forward_work(sub.jaxpr if isinstance(sub, jcore.ClosedJaxpr) else sub,
                                       where)
    return n


def layer_forward_runs(kernel, remat: str, **kw) -> float:
    """How many times a layer's gradient under ``model.remat=remat`` runs ``kernel``'s
    forward: its forward work in the gradient's jaxpr over that of one forward. The
    layer: named projections (decoder.Attention's names), the kernel, a named output."""
    b, s, h, kv, d = 2, 64, 4, 2, 16
    x = jax.random.normal(jax.random.key(0), (b, s, h, d), jnp.float32)
    seg = jnp.ones((b, s), jnp.int32)
    cfg = types.SimpleNamespace(attn_kv_tile=16, cp_layout="zigzag", attn_max_docs=4)

    def layer(x):
        q = checkpoint_name(x * 2, "q_proj")
        k, v = (checkpoint_name(x[:, :, :kv] * c, n) for c, n in ((3, "k_proj"), (4, "v_proj")))
        out = checkpoint_name(kernel(q, k, v, seg, cfg, **kw), "attn_out")
        return jnp.sin(out.astype(jnp.float32)).sum()

    once = _forward_work(jax.make_jaxpr(layer)(x).jaxpr)
    assert once > 0
    grad = jax.grad(jax.checkpoint(layer, policy=decoder.REMAT_POLICIES[remat]))
    return _forward_work(jax.make_jaxpr(grad)(x).jaxpr) / once


@pytest.mark.parametrize("impl", [
    pytest.param(n, marks=needs_pallas if n == "pallas" else ())
    for n, k in attn.KERNELS.items() if k.saves == kernel_vjp.RESIDUALS and n != "cudnn"])
def test_kernels_with_their_own_vjp_rerun_their_forward_only_under_full_remat(impl):
    """Their output and log-sum-exp residuals are named (kernel_vjp), so every policy
    that saves attn_out/attn_lse keeps them, and only full remat (and offload, full's
    with the inputs on the host) reruns the kernel: what roofline.RERUN prices. Pallas
    traced for interpret mode; cuDNN's count is tests/test_gpu_compile.py's."""
    for remat in decoder.REMAT_POLICIES:
        want = 2 if "attention" in roofline.RERUN[remat] else 1
        assert layer_forward_runs(attn.KERNELS[impl], remat) == want, remat


def test_site_takes_the_models_specs():
    cfg = types.SimpleNamespace(n_heads=4, n_kv_heads=2, hd=16, dtype="float32",
                                cp_layout="zigzag", attn_kv_tile=8)
    assert attn.Site.of(cfg, 64, None).specs == (Spec(),)
    cfg.attention_specs = [Spec(window=8), Spec()]
    assert attn.Site.of(cfg, 64, None).specs == (Spec(window=8), Spec())


def test_attention_refuses_a_layer_spec_its_kernel_does_not_compute():
    """A layer's spec that the kernel's choice never saw (not in cfg.attention_specs)
    is refused when traced, never run without the cap."""
    cfg = types.SimpleNamespace(attn_impl="auto", n_heads=4, n_kv_heads=2, hd=16,
                                dtype="float32", cp_layout="zigzag", attn_kv_tile=8)
    q, k, v, seg, _ = _inputs(1, 2048, 4, 2, 16)
    with pytest.raises(ConfigError, match="'tiled' has no logit soft cap"):
        jax.eval_shape(lambda *a: attn.attention(*a, cfg, Spec(softcap=5.0)), q, k, v, seg)
    cfg.attention_specs = (Spec(softcap=5.0),)  # now auto knows: blocked
    jax.eval_shape(lambda *a: attn.attention(*a, cfg, Spec(softcap=5.0)), q, k, v, seg)


def test_start_up_line_says_kernel_and_why():
    exp = Experiment.from_config(tiny_config(mesh=dict(fsdp=8)))
    assert exp.model_cfg.attn_impl == "dense"
    assert exp.attention.describe() == (
        "dense (the whole score matrix, O(seq^2) memory; auto on CPU, seq_len 32 <= 256)")


@pytest.mark.parametrize("impl", ["tiled", "blocked", pytest.param("pallas", marks=needs_pallas)])
def test_kernel_trains_like_dense(impl):
    """The whole step (the kernel's custom VJP inside the layer scan, under FSDP x TP)
    gives the single-device dense losses and parameters. ``pallas`` is refused on CPU
    by Experiment's check, so the model is handed the kernel name directly."""
    exp = Experiment.from_config(tiny_config(mesh=dict(fsdp=4, tensor=2),
                                             model=dict(attn_kv_tile=8)))
    exp.model_cfg = dataclasses.replace(exp.model_cfg, attn_impl=impl)
    exp.graphdef = _graphdef(exp.graphdef, exp.model_cfg)
    # Another kernel sums its tiles in another order: the first step's gradients and
    # the losses are compared (helpers.assert_same_training), not Adam's parameters.
    assert_same_training(exp, {})


def _graphdef(built, cfg):
    """The graph of the model class that ``built`` (an Experiment's graphdef) holds, for
    ``cfg``: whichever model class the Experiment builds."""
    from flax import nnx

    model_class = built.nodes[0].type
    return nnx.split(nnx.eval_shape(lambda: model_class(cfg, nnx.Rngs(0))))[0]


def test_auto_attention_memory_is_linear_in_the_sequence():
    """Compiled step temporaries, batch 1: 4x the tokens may cost at most 5x the
    memory (dense attention's scores grow 16x)."""
    def temp(seq_len):
        exp = Experiment.from_config(tiny_config(
            mesh=dict(fsdp=1), train=dict(batch_size=1, seq_len=seq_len),
            model=dict(n_layers=1)), devices=jax.devices()[:1])
        assert exp.model_cfg.attn_impl == "tiled", exp.attention
        return exp.lower_step().compile().memory_analysis().temp_size_in_bytes

    small, large = temp(4096), temp(16384)
    assert large <= 5 * small, (small, large)


def test_gpu_compile_options_and_overrides():
    assert compiler.options("cpu", {}) == compiler.CPU_OPTIONS
    assert compiler.options("cpu", {"XLA_FLAGS": "--xla_disable_hlo_passes=x"}) == {}
    assert compiler.options("tpu", {}) == {}
    gpu = compiler.options("gpu", {})
    assert gpu["xla_gpu_enable_latency_hiding_scheduler"] is True
    assert compiler.options("gpu", {compiler.ENV: "none"}) == {}
    env = {compiler.ENV: "xla_gpu_enable_latency_hiding_scheduler=false,xla_extra=7",
           "XLA_FLAGS": "--xla_gpu_all_reduce_combine_threshold_bytes=1"}
    got = compiler.options("gpu", env)
    assert got["xla_gpu_enable_latency_hiding_scheduler"] is False and got["xla_extra"] == 7
    assert "xla_gpu_all_reduce_combine_threshold_bytes" not in got  # XLA_FLAGS decides


def test_unknown_compile_option_is_dropped_with_a_warning():
    lowered = jax.jit(lambda x: x * 2).lower(jnp.ones(3))
    with pytest.warns(UserWarning, match="does not know the compile option 'xla_no_such'"):
        compiled = compiler.compile_step(lowered, {"xla_no_such": True,
                                                   "xla_gpu_enable_latency_hiding_scheduler": True})
    np.testing.assert_array_equal(compiled(jnp.ones(3)), 2 * np.ones(3))
    # The quick CPU options (the planner's and a small init's) name an option jax 0.12's
    # XLA retired (the older emitters): dropped there without a warning, used on 0.10.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quick = compiler.compile_step(lowered, compiler.CPU_QUICK_OPTIONS, "cpu")
    np.testing.assert_array_equal(quick(jnp.ones(3)), 2 * np.ones(3))


_FAULTS_SCRIPT = """
import ctypes, resource, time
RUNS = 10
import ndjax  # first, as train.py and the CLIs do
from ndjax.runtime import cpu_malloc
print(cpu_malloc.applied)
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.sum(jnp.cumsum(x) * jnp.cumsum(x[::-1])))
x = jnp.ones((16 * 2**20,), jnp.float32)
temp = f.lower(x).compile().memory_analysis().temp_size_in_bytes
print(temp)

class MallInfo(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost").split()]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo

def held():  # bytes malloc has handed out, from its heaps and from mmap
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd

idle = held()
faults, heap = [], []
for _ in range(RUNS):
    # The runtime frees a run's temporaries after its result is ready: a run started
    # before then needs a second block (new memory, faulted in) whatever malloc keeps.
    # Waiting for the free counts what the settings decide, not the threads' timing.
    deadline = time.monotonic() + 5
    while held() > idle + temp // 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    heap.append(libc.mallinfo2().arena)
print(",".join(map(str, faults)), ",".join(map(str, heap)))
libc.malloc_stats()  # on stderr, a line "Arena N:" per malloc arena
"""


@pytest.mark.parametrize("malloc", ["", "default"])
def test_importing_ndjax_keeps_step_temporaries_mapped(malloc):
    """With the malloc settings ``import ndjax`` applies on CPU, a step's large temporaries
    are not faulted in again on the next run (counted in page faults, not timed), and
    every thread shares one malloc arena: an arena made before the settings (a thread
    that allocated before ndjax was imported) mmaps large blocks on every run.
    NDJAX_CPU_MALLOC=default leaves glibc's settings, which do fault them in. Each run
    starts once the previous one's temporaries are freed (jax 0.12 frees them after the
    result is ready, and a run that starts first needs a second block).

    The first runs grow the heap until its free blocks fit every temporary: three runs
    here (~700 MiB), but on CI's loaded machine the third to fifth runs of five still
    grew it by a whole block each. Ten runs, and the settled state is read from the
    last six; the message has each run's faults and heap size."""
    import os
    import subprocess
    import sys

    from ndjax.runtime import cpu_malloc

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu", **{cpu_malloc.ENV: malloc})
    out = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    applied, temp, faults, heap = out.stdout.split()
    pages = int(temp) // 4096  # ~190 MiB of temporaries
    faults = [int(f) for f in faults.split(",")]
    print("faults per run", faults, "heap bytes after each", heap)
    later = faults[4:]  # the first runs grow the heap
    if malloc == "default":
        assert applied == "False" and min(later) > pages // 2, out.stdout
    else:
        arenas = out.stderr.count("Arena ")
        assert applied == "True" and arenas == 1 and min(later) < pages // 10, \
            (out.stdout, arenas)


def test_malloc_settings_are_for_cpu_only_processes():
    from ndjax.runtime import cpu_malloc

    assert cpu_malloc.cpu_only({"JAX_PLATFORMS": "cpu"})
    assert not cpu_malloc.cpu_only({"JAX_PLATFORMS": "cuda,cpu"})
    assert not cpu_malloc.cpu_only({"JAX_PLATFORMS": "tpu"})
