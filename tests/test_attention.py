"""Every attention kernel equals ``dense`` (forward and gradients); ``auto`` picks
as documented; an explicit kernel that cannot run is a ConfigError.

Tolerance: max abs diff <= 2e-5 in float32 for outputs and gradients of order 1.
The kernels sum the same softmax in a different order (online, tile by tile),
which moves results by a few ulps. The Pallas kernel runs in interpret mode on
CPU: the same program a GPU compiles with Triton, executed by XLA.
"""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from helpers import assert_same_training

from ndjax import compiler
from ndjax.errors import ConfigError
from ndjax.experiment import Experiment
from ndjax.ops import attention as attn

ATOL = 2e-5
# (heads, kv heads): multi-head, grouped-query, multi-query.
HEADS = [(4, 4), (4, 2), (4, 1)]


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


def _assert_matches_dense(fn, heads, kv_heads, s=64, d=16):
    args = _inputs(2, s, heads, kv_heads, d)
    got = jax.jit(lambda *a: _output_and_grads(fn, *a))(*args)
    want = jax.jit(lambda *a: _output_and_grads(attn.dense, *a))(*args)
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


@pytest.mark.parametrize("heads, kv_heads", HEADS)
def test_pallas_matches_dense(heads, kv_heads):
    _assert_matches_dense(lambda *a: attn.pallas_attention(*a, interpret=True), heads,
                          kv_heads)


def _cudnn_semantics(q, k, v, lengths, offsets, *, scale):
    """What jax's cuDNN attention computes for packed rows (PADDING_CAUSAL with
    sequence offsets), written plainly: each (offset, length) is a sequence, causal
    inside it. Tokens outside every sequence get no output (zeros)."""
    s = q.shape[1]
    t = jnp.arange(s)
    starts, lengths = offsets[:, :-1, None], lengths[:, :, None]
    inside = (starts >= 0) & (t >= starts) & (t < starts + lengths)   # (b, runs, s)
    run = jnp.where(inside.any(1), jnp.argmax(inside, axis=1) + 1, 0)
    assert scale == pytest.approx(q.shape[-1] ** -0.5)
    return attn.dense(q, k, v, run) * inside.any(1)[:, :, None, None]


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


@pytest.mark.parametrize("heads, kv_heads", HEADS)
def test_cudnn_kernel_matches_dense_given_cudnn_semantics(heads, kv_heads, monkeypatch):
    """No GPU here: cuDNN itself is replaced by a plain statement of its packed-row
    semantics, so this checks ndjax's side (segment ids -> ragged sequences)."""
    monkeypatch.setattr(attn, "_cudnn_packed", _cudnn_semantics)
    _assert_matches_dense(lambda q, k, v, seg: attn.KERNELS["cudnn"](q, k, v, seg, CUDNN_CFG),
                          heads, kv_heads)


def _site(**kw):
    base = dict(seq_len=4096, n_heads=32, n_kv_heads=8, head_dim=64, dtype=jnp.bfloat16,
                context=1, platform="gpu", layout="zigzag", kv_tile=512,
                compute_capability="9.0")
    return attn.Site(**{**base, **kw})


def test_auto_choices():
    assert attn.choose("auto", _site()).name == "cudnn"
    f32 = attn.choose("auto", _site(dtype=jnp.float32))
    assert f32.name == "pallas" and "needs bfloat16 or float16" in f32.why, f32
    assert attn.choose("auto", _site(compute_capability="8.0")).name == "pallas"
    assert attn.choose("auto", _site(context=4)).name == "ring"
    # One row per micro-batch on several GPUs: jax's cuDNN sharding rule fails to
    # verify (tests/test_gpu_compile.py compiles both cases).
    assert attn.choose("auto", _site(rows=1, devices=2)).name == "pallas"
    assert attn.choose("auto", _site(rows=1, devices=1)).name == "cudnn"
    odd = attn.choose("auto", _site(dtype=jnp.float32, seq_len=4000, kv_tile=500))
    assert odd.name == "tiled" and "pallas" in odd.why, odd
    cpu = dict(platform="cpu", compute_capability=None, dtype=jnp.float32)
    assert attn.choose("auto", _site(**cpu)).name == "tiled"
    assert attn.choose("auto", _site(**cpu, seq_len=128)).name == "dense"
    assert attn.choose("auto", _site(**cpu, seq_len=256)).name == "blocked"
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
    ("cudnn", dict(context=2), r"runs on one context shard"),
    ("pallas", dict(seq_len=4000), r"blocks of 128 tokens at head_dim 64, and train.seq_len=4000"),
    ("pallas", dict(platform="cpu"), r"runs on NVIDIA GPUs, and this run's devices are cpu"),
    ("dense", dict(context=2), None),
    ("blocked", dict(context=2), r"runs on one context shard"),
])
def test_explicit_kernel_checks(impl, site, match):
    if match is None:
        assert attn.choose(impl, _site(**site)).name == impl
        return
    with pytest.raises(ConfigError, match=match) as e:
        attn.choose(impl, _site(**site))
    assert "\n" not in str(e.value)


def test_start_up_line_says_kernel_and_why():
    exp = Experiment.from_config(tiny_config(mesh=dict(fsdp=8)))
    assert exp.model_cfg.attn_impl == "dense"
    assert exp.attention.describe() == (
        "dense (the whole score matrix, O(seq^2) memory; auto on CPU, seq_len 32 <= 128)")


@pytest.mark.parametrize("impl", ["tiled", "blocked", "pallas"])
def test_kernel_trains_like_dense(impl):
    """The whole step (the kernel's custom VJP inside the layer scan, under FSDP x TP)
    gives the single-device dense losses and parameters. ``pallas`` is refused on CPU
    by Experiment's check, so the model is handed the kernel name directly."""
    exp = Experiment.from_config(tiny_config(mesh=dict(fsdp=4, tensor=2),
                                             model=dict(attn_kv_tile=8)))
    exp.model_cfg = dataclasses.replace(exp.model_cfg, attn_impl=impl)
    exp.graphdef = _graphdef(exp.model_cfg)
    # Another kernel sums its tiles in another order: the first step's gradients and
    # the losses are compared (helpers.assert_same_training), not Adam's parameters.
    assert_same_training(exp, {})


def _graphdef(cfg):
    from flax import nnx

    from ndjax.models import llama
    return nnx.split(nnx.eval_shape(lambda: llama.Llama(cfg, nnx.Rngs(0))))[0]


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
    assert compiler.options("cpu", {}) == {}
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


_FAULTS_SCRIPT = """
import resource
from ndjax import compiler
print(compiler.cpu_runtime_defaults())
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.sum(jnp.cumsum(x) * jnp.cumsum(x[::-1])))
x = jnp.ones((16 * 2**20,), jnp.float32)
print(f.lower(x).compile().memory_analysis().temp_size_in_bytes)
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(min(faults[2:]))  # the first runs grow the heap (a block may be freed late)
"""


@pytest.mark.parametrize("malloc", ["", "default"])
def test_cpu_runtime_defaults_keep_step_temporaries_mapped(malloc):
    """With ndjax's CPU malloc settings a step's large temporaries are not faulted in
    again on the next run (counted in page faults, not timed); NDJAX_CPU_MALLOC=default
    leaves glibc's settings, which do fault them in."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu", **{compiler.MALLOC_ENV: malloc})
    out = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    applied, temp, faults = out.stdout.split()
    pages = int(temp) // 4096  # ~190 MiB of temporaries
    if malloc == "default":
        assert applied == "False" and int(faults) > pages // 2, out.stdout
    else:
        assert applied == "True" and int(faults) < pages // 10, out.stdout
