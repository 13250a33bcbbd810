"""The experts' grouped matmuls (ndjax.ops.grouped_matmul) at their edges, each
implementation against ``jax.lax.ragged_dot`` in float32: rows past the groups,
empty groups, one group holding every row, no row in any group; and the MoE dispatch
through them in capacity mode (pairs dropped) and under expert parallelism with every
token on one expert.

What runs: jax's Mosaic GPU kernels themselves (``moe_impl='mosaic'``), in Mosaic
GPU's interpreter on CPU, which fills the memory a kernel does not write with NaN, so
a row a kernel leaves unwritten shows. The weights' gradient kernel
(``transposed_ragged_dot``) runs interpreted from jax 0.12 (CI's second leg); jax
0.10's interpreter cannot run it and XLA's contraction stands in for it there, as each
test says where it matters. Not checked here: the kernels' numbers on a real Hopper
GPU (wgmma, TMA, the persistent schedule over 132 SMs): bench/gpu.py's first cases,
unchecked until a GPU runs them.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_moe import make_moe

from ndjax.models import moe
from ndjax.ops import grouped_matmul as gm

# (rows, K, N, group sizes): each past-the-groups row of x and dy is NaN.
EDGES = {
    "rows_past_the_groups": (128, 128, 64, [40, 0, 30, 0]),
    "one_group_holds_every_row": (200, 64, 128, [0, 200, 0, 0]),  # 200: padded to 256
    "uneven_groups": (200, 128, 64, [70, 0, 60, 70]),
    "no_row_in_any_group": (64, 64, 64, [0, 0, 0, 0]),
}


def _f32(a) -> np.ndarray:
    return np.asarray(a, np.float32)


def _bound(a: np.ndarray, b: np.ndarray, terms: int) -> np.ndarray:
    """How far a bfloat16 result may be from the float32 one of the same bfloat16
    inputs: its rounding (half an ulp, 2^-8 of it) plus float32's summation error over
    ``terms`` products (terms x 2^-24 x the sum of |products|)."""
    return 2.0**-8 * np.abs(b) + terms * 2.0**-24 * a


def _grouped_vjp(impl, x, w, sizes, dy):
    out, pullback = jax.vjp(lambda x, w: gm.grouped_matmul(x, w, sizes, impl), x, w)
    return (out, *pullback(dy.astype(out.dtype)))


@pytest.mark.parametrize("impl", ["mosaic", "xla"])
@pytest.mark.parametrize("case", list(EDGES))
def test_grouped_matmuls_are_zero_past_the_groups_and_match_float32(case, impl):
    """bfloat16 product, rows' gradient and weights' gradient against ragged_dot in
    float32 on the same inputs, within bfloat16's rounding; the rows past the groups
    hold NaN in x and dy and come back exactly zero in the product and the rows'
    gradient; an empty group's weights' gradient is exactly zero. On today's main the
    Mosaic product left 3,712 values of the first case unwritten (NaN), its rows'
    gradient 7,424, and transposed_ragged_dot read the NaN rows into 8,192 values of
    the weights' gradient (jax 0.12's interpreter)."""
    m, k, n, groups = EDGES[case]
    rng = np.random.default_rng(0)
    sizes = jnp.asarray(groups, jnp.int32)
    total = sum(groups)
    x, dy = rng.normal(size=(m, k)), rng.normal(size=(m, n))
    x[total:], dy[total:] = np.nan, np.nan
    x, dy = jnp.asarray(x, jnp.bfloat16), jnp.asarray(dy, jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(len(groups), k, n)), jnp.bfloat16)
    got = [_f32(a) for a in jax.jit(_grouped_vjp, static_argnums=0)(impl, x, w, sizes, dy)]

    # The reference: ragged_dot in float32 on the same values, the NaN rows zeroed.
    x32, dy32 = (jnp.nan_to_num(a.astype(jnp.float32)) for a in (x, dy))
    want = [_f32(a) for a in _grouped_vjp("xla", x32, w.astype(jnp.float32), sizes, dy32)]
    magnitudes = [_f32(a) for a in _grouped_vjp("xla", jnp.abs(x32), jnp.abs(w.astype(
        jnp.float32)), sizes, jnp.abs(dy32))]
    for name, g, r, a, terms in zip(("product", "rows' gradient", "weights' gradient"),
                                    got, want, magnitudes, (k, n, m)):
        assert not np.isnan(g).any(), f"{name}: {np.isnan(g).sum()} NaN"
        excess = np.abs(g - r) - _bound(a, r, terms)
        assert excess.max() <= 0, (name, float(excess.max()))
    product, dx, dw = got
    assert not product[total:].any() and not dx[total:].any()
    assert not dw[np.asarray(groups) == 0].any()
    if impl == "mosaic" and total:
        # The bf16 results differ from the float32 ones somewhere (they are bf16's),
        # so the comparison above had something to compare.
        assert (product[:total] != want[0][:total]).any()


def test_the_weights_gradient_kernel_runs_where_the_interpreter_can():
    """Which contraction the weights' gradient takes on CPU: jax's Mosaic kernel (its
    body, wgmma and all, in the jaxpr) from jax 0.12, XLA's ragged_dot_general before;
    on a GPU always the kernel (tests/test_gpu_compile.py counts its custom calls)."""
    x = jnp.ones((128, 64), jnp.bfloat16)
    sizes = jnp.asarray([64, 64], jnp.int32)
    text = str(jax.make_jaxpr(gm._contraction)(x, x, sizes))
    assert ("wgmma" in text) == gm.INTERPRETER_RUNS_CONTRACTION
    assert ("ragged_dot_general" in text) != gm.INTERPRETER_RUNS_CONTRACTION


def _routing(rng, tokens_shape, n_experts, k, one_expert=False):
    if one_expert:  # every token's first choice is expert 0
        experts = np.stack([np.zeros(tokens_shape, np.int64),
                            rng.integers(1, n_experts, tokens_shape)], axis=-1)[..., :k]
    else:
        experts = np.argsort(rng.normal(size=(*tokens_shape, n_experts)), axis=-1)[..., :k]
    weights = rng.uniform(0.1, 1.0, (*tokens_shape, k))
    return jnp.asarray(experts, jnp.int32), jnp.asarray(weights, jnp.float32)


def _dispatch_grads(run, x, weights, ws):
    """The dispatch's output and its gradients for a fixed random cotangent."""
    def f(x, weights, *ws):
        out, pullback = jax.vjp(lambda *a: run(*a).astype(jnp.float32), x, weights, *ws)
        d_out = jax.random.normal(jax.random.key(0), out.shape, jnp.float32)
        return out, pullback(d_out)
    return jax.jit(f)(x, weights, *ws)


def _assert_dispatch_matches_float32(got, want, what):
    """bfloat16 Mosaic against float32 ragged_dot: every value finite, each within 2%
    of that result's largest magnitude (three bf16 matmuls and a SwiGLU in a row; one
    grouped matmul in bf16 is 0.2-0.3% off, test_grouped_matmuls_... above)."""
    names = ("output", "x", "routing weights", "w_gate", "w_up", "w_down")
    for name, g, r in zip(names, jax.tree.leaves(got), jax.tree.leaves(want)):
        g, r = _f32(g), _f32(r)
        assert np.isfinite(g).all(), f"{what}, {name}: {(~np.isfinite(g)).sum()} not finite"
        np.testing.assert_allclose(g, r, rtol=0, atol=0.02 * np.abs(r).max(),
                                   err_msg=f"{what}, {name}")


def test_capacity_mode_dispatch_through_the_mosaic_kernels_has_ragged_dots_gradients():
    """32 tokens, top-2 of 8 experts, at most one pair per expert and row: 8 of 64
    pairs kept, the 56 dropped sorted past the groups. On today's main the interpreted
    kernels gave NaN gradients to 19 of the 32 tokens, with a finite output."""
    rng = np.random.default_rng(3)
    b, s, d, f, e, k = 1, 32, 64, 64, 8, 2
    x = jnp.asarray(rng.normal(size=(b, s, d)), jnp.float32)
    experts, weights = _routing(rng, (b, s), e, k)
    keep = moe.within_capacity(experts, e, 1)
    assert int(keep.sum()) == 8
    ws = [jnp.asarray(rng.normal(0, 0.3, shape), jnp.float32)
          for shape in ((e, d, f), (e, d, f), (e, f, d))]

    def run(impl, dtype):
        def f(x, weights, *ws):
            return moe.dispatch(x.astype(dtype), experts, weights, *(w.astype(dtype) for w in ws),
                                impl=impl, keep=keep)
        return f
    _assert_dispatch_matches_float32(_dispatch_grads(run("mosaic", jnp.bfloat16), x, weights, ws),
                                     _dispatch_grads(run("xla", jnp.float32), x, weights, ws),
                                     "capacity mode")


def test_an_expert_devices_chunked_buffer_with_every_token_on_one_expert():
    """What expert parallelism hands the kernels on the device holding expert 0 when
    every token chose it (moe._in_chunks, as moe.dispatch_over calls it): a receive
    buffer of 4 senders' 32 rows, 70 of them expert 0's, none its second expert's, the
    rest unfilled (NaN here); chunks 0-1 full, chunk 2 with 6 rows in a group, chunk 3
    in none (skipped by a lax.cond). Mosaic in bfloat16 against ragged_dot in float32.
    Not run here: the exchange itself with the Mosaic kernels (the interpreter runs a
    kernel inside a multi-device shard_map as one launch whose devices meet at a
    barrier, and on CI's 2 cores they hang there); test_moe's all-tokens-to-expert-2
    case runs it with ragged_dot, and bench/gpu.py on a GPU."""
    rng = np.random.default_rng(5)
    chunks, rows, d, f = 4, 32, 64, 128
    sizes = jnp.asarray([70, 0], jnp.int32)
    x = rng.normal(size=(chunks * rows, d))
    x[70:] = np.nan
    x = jnp.asarray(x, jnp.bfloat16)
    w = jnp.asarray(rng.normal(0, 0.3, (2, d, f)), jnp.bfloat16)
    dy = jnp.asarray(rng.normal(size=(chunks * rows, f)), jnp.bfloat16)

    def run(impl, x, w, dy):
        out, pullback = jax.vjp(lambda x, w: moe._in_chunks(x, w, sizes, impl, chunks), x, w)
        return (out, *pullback(dy.astype(out.dtype)))
    got = [_f32(a) for a in jax.jit(run, static_argnums=0)("mosaic", x, w, dy)]
    x32, w32, dy32 = jnp.nan_to_num(x.astype(jnp.float32)), w.astype(jnp.float32), _f32(dy)
    want = [_f32(a) for a in run("xla", x32, w32, dy32)]
    magnitudes = [_f32(a) for a in run("xla", jnp.abs(x32), jnp.abs(w32), np.abs(dy32))]
    # The weights' gradient is each chunk's, in bfloat16, summed in bfloat16: a rounding
    # of at most 2^-8 of the magnitudes per chunk more.
    extra = (0, 0, chunks * 2.0**-8)
    for name, g, r, a, more in zip(("product", "rows' gradient", "weights' gradient"), got,
                                   want, magnitudes, extra):
        assert not np.isnan(g).any(), f"{name}: {np.isnan(g).sum()} NaN"
        excess = np.abs(g - r) - _bound(a, r, chunks * rows) - more * a
        assert excess.max() <= 0, (name, float(excess.max()))
    assert not got[0][70:].any() and not got[1][70:].any() and not got[2][1].any()


def test_the_moe_layer_in_capacity_mode_through_the_mosaic_kernels():
    """One device's MoE layer in capacity mode (pairs dropped) with model.moe_impl=
    'mosaic' set on its config (Experiment refuses it on CPUs, where the kernels only
    run interpreted), its router, top-k and dispatch as a train step runs them: the loss
    and every parameter's gradient in bfloat16 against the same layer with ragged_dot.
    Not run: a whole train step, nor a multi-device layout, through the interpreted
    kernels (see the test above for why)."""
    cfg, layer = make_moe(dim=64, moe_ffn_dim=64, capacity_factor=1.0, dtype="bfloat16")
    x = jnp.asarray(np.random.default_rng(6).normal(size=(2, 16, 64)), jnp.float32)
    graphdef, params = nnx.split(layer)

    def grads(impl):
        def loss(params):
            model = nnx.merge(graphdef, params)
            model.cfg = dataclasses.replace(cfg, moe_impl=impl)
            out, stats = model(x.astype(jnp.bfloat16))
            return jnp.sum(jnp.sin(out.astype(jnp.float32))), stats["dropped"]
        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    (loss, dropped), got = grads("mosaic")
    (want_loss, _), want = grads("xla")
    assert float(dropped) > 0  # pairs were dropped, or this would test dropless only
    # Both in bfloat16, summed in other orders through three matmuls and a SwiGLU: the
    # tolerance of _assert_dispatch_matches_float32. What this test is for is the
    # finiteness below (the dropped pairs' gradients were NaN).
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-2)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, r = _f32(g), _f32(r)
        assert np.isfinite(g).all()
        np.testing.assert_allclose(g, r, rtol=0, atol=0.02 * np.abs(r).max())
