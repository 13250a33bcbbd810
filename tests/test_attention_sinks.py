"""Attention sinks (GPT-OSS): every kernel that honours them equals transformers' eager
formula (forward, and gradients of q, k, v and the sink logits); the fused kernels that
do not refuse them.

The reference is written here, independent of the kernels: kv heads repeated, the whole
score matrix masked (causal, documents, window), the sink logit concatenated as one more
column, softmax in float32, the column dropped, times v (transformers'
``GptOss`` ``eager_attention_forward``).

Tolerance: max abs and rel diff <= 1e-5 in float32 (outputs and gradients of order 1,
the sinks' gradients summed over 4 x 32 queries): the kernels sum the same softmax in
another order (tile by tile, online), which moves results by a few ulps.
"""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ndjax.ops import attention as attn
from ndjax.ops import ring_attention as ra
from ndjax.parallel.mesh import ParallelDims, build_mesh
from ndjax.parallel.rules import Rules, use
from ndjax.runtime.errors import ConfigError

TOL = dict(atol=1e-5, rtol=1e-5)
Spec = attn.AttentionSpec
SEQ, HEADS, KV_HEADS, HEAD_DIM = 32, 4, 2, 8
# Mixed signs, one large enough to take most of its rows' weight.
SINKS = np.array([5.0, -2.0, 0.3, 1.5], np.float32)
CFG = types.SimpleNamespace(attn_kv_tile=4, cp_layout="zigzag")


def _inputs(seq=SEQ, b=4, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, seq, HEADS, HEAD_DIM))
    k = jax.random.normal(ks[1], (b, seq, KV_HEADS, HEAD_DIM))
    v = jax.random.normal(ks[2], (b, seq, KV_HEADS, HEAD_DIM))
    dout = jax.random.normal(ks[3], (b, seq, HEADS, HEAD_DIM))
    # Packed rows: row 0 three documents then padding (segment 0); row 1 two, the
    # second crossing the middle (the tiled kernel's halves, the ring's chunks); row 2
    # one; row 3 documents of 3 tokens (most key tiles skipped).
    seg = np.zeros((b, seq), np.int32)
    seg[0, :9], seg[0, 9:17], seg[0, 17:seq - 4] = 1, 2, 3
    seg[1, :7], seg[1, 7:] = 1, 2
    seg[2], seg[3] = 1, np.arange(seq) // 3 + 1
    return q, k, v, jnp.asarray(seg), dout


def reference(q, k, v, seg, sinks, spec=None):
    """transformers' eager GPT-OSS attention, on packed rows; ``sinks`` None: without
    the sink's column."""
    spec = spec or Spec()
    b, s, h, d = q.shape
    k, v = (jnp.repeat(x, h // x.shape[2], axis=2) for x in (k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * spec.scale_for(d)
    idx = jnp.arange(s)
    mask = (idx[:, None] >= idx[None]) & (seg[:, :, None] == seg[:, None, :])
    if spec.window is not None:
        mask &= idx[:, None] - idx[None] < spec.window
    scores = jnp.where(mask[:, None], scores, jnp.finfo(jnp.float32).min)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        column = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None, None], (b, h, s, 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, column], -1), axis=-1)[..., :-1]
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def _output_and_grads(fn, q, k, v, seg, dout, sinks):
    """(out, dq, dk, dv, dsinks) for the cotangent ``dout``."""
    out, vjp = jax.vjp(lambda q, k, v, sinks: fn(q, k, v, seg, sinks), q, k, v, sinks)
    return (out, *vjp(dout))


def _assert_matches_reference(fn, spec=None):
    q, k, v, seg, dout = _inputs()
    sinks = jnp.asarray(SINKS)
    got = jax.jit(lambda *a: _output_and_grads(fn, *a))(q, k, v, seg, dout, sinks)
    want = jax.jit(lambda *a: _output_and_grads(
        lambda q, k, v, seg, s: reference(q, k, v, seg, s, spec), *a))(q, k, v, seg, dout, sinks)
    for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        np.testing.assert_allclose(g, w, **TOL, err_msg=name)
    return got


def _kernel(impl, spec):
    if impl == "blocked":  # 4 query blocks, two of them with a choice of key ranges
        return lambda q, k, v, seg, sinks: attn.blocked(q, k, v, seg, 4, spec, sinks)
    return lambda q, k, v, seg, sinks: attn.KERNELS[impl](q, k, v, seg, CFG, spec, sinks)


# Windows: 2 runs blocked's window_chunks (asserted below); 6 spans two of tiled's
# 4-token key tiles.
@pytest.mark.parametrize("impl, window", [("dense", None), ("dense", 5), ("blocked", None),
                                          ("blocked", 2), ("tiled", None), ("tiled", 6)])
def test_one_shard_kernels_match_the_reference(impl, window):
    spec = Spec(window=window, sinks=True)
    if impl == "blocked" and window is not None:
        assert attn._chunks_work(SEQ, window) < attn._blocks_work(SEQ, 4, window)
    got = _assert_matches_reference(_kernel(impl, spec), spec)
    assert np.abs(got[-1]).min() > 1e-2  # every sink's gradient is far from zero


def test_dense_in_the_gpus_score_order(monkeypatch):
    """The score matrices as GPUs hold them, (query group, query, key): the sinks
    indexed by (kv head, group) there too."""
    monkeypatch.setattr(attn.platforms, "current", lambda: "gpu")
    _assert_matches_reference(_kernel("dense", Spec(sinks=True)))


def test_sinks_in_bfloat16_get_their_gradient_in_bfloat16():
    """The flash kernels' own VJP casts it back (autodiff does in the dense ones)."""
    args = (*_inputs(), jnp.asarray(SINKS, jnp.bfloat16))
    grads = jax.eval_shape(lambda *a: _output_and_grads(_kernel("tiled", Spec(sinks=True)),
                                                        *a), *args)
    assert grads[-1].dtype == jnp.bfloat16


def test_a_sink_free_call_is_the_kernel_without_sinks():
    """sinks=None: no sink's column anywhere (the reference without it); in the flash
    kernel a sink of -inf changes no bit, so the sink only joins the statistics."""
    q, k, v, seg, dout = _inputs()
    want = jax.jit(reference)(q, k, v, seg, None)
    for impl in ("dense", "tiled"):
        run = jax.jit(lambda *a, impl=impl: attn.KERNELS[impl](*a, CFG))
        np.testing.assert_allclose(run(q, k, v, seg), want, **TOL, err_msg=impl)
    tiled = jax.jit(lambda *a: _output_and_grads(_kernel("tiled", Spec(sinks=True)), *a))
    free = jax.jit(lambda *a: _output_and_grads(
        lambda q, k, v, seg, _: attn.KERNELS["tiled"](q, k, v, seg, CFG), *a))
    no_sink = jnp.full((HEADS,), -jnp.inf)
    for name, g, w in zip(("out", "dq", "dk", "dv"), tiled(q, k, v, seg, dout, no_sink),
                          free(q, k, v, seg, dout, no_sink)):
        np.testing.assert_array_equal(g, w, err_msg=name)


@pytest.mark.parametrize("context, layout", [(2, "zigzag"), (4, "contiguous"), (4, "zigzag")])
def test_ring_matches_the_reference(context, layout):
    """The sink joins once, after every ring step: c times would show at c = 2 and 4."""
    mesh = build_mesh(ParallelDims(fsdp=8 // context, context=context))
    perm = ra.layout_permutation(layout, SEQ, context)
    perm = np.arange(SEQ) if perm is None else perm
    undo = np.argsort(perm)

    def ring(q, k, v, seg, sinks):  # in the natural order, as the reference's
        out = ra.ring_attention(*(x[:, perm] for x in (q, k, v, seg)), mesh=mesh,
                                layout=layout, kv_tile=4, sinks=sinks)
        return out[:, undo]

    _assert_matches_reference(ring)


@pytest.mark.parametrize("impl, mesh", [("tiled", dict(fsdp=4, tensor=2)),
                                        ("ring", dict(fsdp=2, context=2, tensor=2))])
def test_flash_kernels_with_heads_split_over_devices(impl, mesh):
    """Under the default rules each device attends for its rows and its 2 of the 4 heads
    (tensor=2), with those heads' sinks; the sinks' gradient sums every device's rows."""
    context = mesh.get("context", 1)
    perm = ra.layout_permutation("zigzag", SEQ, context)
    undo = np.argsort(perm)

    def kernel(q, k, v, seg, sinks):
        return _kernel(impl, Spec(sinks=True))(*(x[:, perm] for x in (q, k, v, seg)),
                                               sinks)[:, undo]

    with use(Rules("default", build_mesh(ParallelDims(**mesh)))):
        _assert_matches_reference(kernel)


@pytest.mark.parametrize("impl, mesh", [("tiled", dict(fsdp=4, context=2)),
                                        ("dense", dict(fsdp=2, context=2, tensor=2))])
def test_all_to_all_gives_each_device_its_heads_sinks(impl, mesh):
    """Context 2: each device attends over the whole sequence for half of its heads,
    with their sinks. With tensor=2 a device holds 2 query heads and 1 kv head, which
    is repeated for each context shard's slice (kv_repeat)."""
    cfg = types.SimpleNamespace(attn_impl=impl, cp_impl="all_to_all", attn_kv_tile=4,
                                cp_layout="zigzag")
    spec = Spec(sinks=True)
    with use(Rules("default", build_mesh(ParallelDims(**mesh)))):
        _assert_matches_reference(lambda q, k, v, seg, sinks: attn.attention(
            q, k, v, seg, cfg, spec, sinks))


@pytest.mark.parametrize("impl", ["cudnn", "pallas"])
def test_fused_kernels_refuse_sinks(impl):
    match = (rf"^model.attn_impl='{impl}' has no attention sinks, and the model's attention "
             r"sets sinks=True \(AttentionSpec\). Use model.attn_impl='auto', 'dense', "
             r"'blocked' or 'tiled'\.$")
    with pytest.raises(ConfigError, match=match):
        attn.KERNELS[impl].check_spec(Spec(sinks=True))
    attn.KERNELS[impl].check_spec(Spec(sinks=False))  # False is no sinks
    q, k, v, seg, _ = _inputs()
    with pytest.raises(ConfigError, match=match):  # called with sinks all the same
        attn.KERNELS[impl](q, k, v, seg, types.SimpleNamespace(attn_max_docs=4),
                           Spec(sinks=True), jnp.asarray(SINKS))


def test_auto_on_a_gpu_takes_a_kernel_with_sinks():
    site = attn.Site(seq_len=4096, n_heads=32, n_kv_heads=8, head_dim=64, dtype=jnp.bfloat16,
                     context=1, platform="gpu", layout="zigzag", kv_tile=512,
                     compute_capability="9.0", specs=(Spec(), Spec(window=128, sinks=True)))
    choice = attn.choose("auto", site)
    assert choice.name == "tiled" and "cudnn: " in choice.why, choice
    context = attn.choose("auto", dataclasses.replace(site, context=4))
    assert context.name == "ring", context


def test_sinks_given_exactly_where_the_spec_has_them():
    q, k, v, seg, _ = _inputs()
    cfg = types.SimpleNamespace(attn_impl="dense", cp_impl="ring")
    with pytest.raises(ValueError, match="spec.sinks=False and sinks given"):
        attn.attention(q, k, v, seg, cfg, Spec(), jnp.asarray(SINKS))
    with pytest.raises(ValueError, match="spec.sinks=True and sinks None"):
        attn.attention(q, k, v, seg, cfg, Spec(sinks=True))
    with pytest.raises(ValueError, match="one sink logit per query head"):
        attn.attention(q, k, v, seg, cfg, Spec(sinks=True), jnp.zeros(KV_HEADS))
