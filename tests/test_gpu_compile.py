"""Every GPU path compiled by XLA's GPU compiler for an H100 or H200 that is not here.

Needs the ``gpu-compile`` extra (``pip install -e '.[gpu-compile]'``; CI installs it
after the rest of the suite has run without it). Without it these tests are
skipped, and ``test_compile_without_the_extra_is_one_line`` checks what a user sees
instead. The compile checks that the real kernels (cuDNN custom calls, Pallas via
Triton, jax's Mosaic GPU grouped matmuls, ring attention's collectives) lower, compile
and fit, and how their memory grows; it checks none of their numbers. On CPU,
tests/test_attention.py checks the Pallas kernel in its interpreter and ndjax's side of
cuDNN (segment ids to ragged sequences, the window and scale it passes) against a
plain statement of cuDNN's semantics, and tests/test_grouped_matmul.py the Mosaic
kernels in theirs. What cuDNN itself computes, and every kernel's numbers on real
Hopper hardware, are unchecked until a GPU runs bench/gpu.py.

Memory figures are XLA's GPU buffer assignment (cuBLAS/cuDNN workspaces excluded).
"""

import functools
import json
import os
import subprocess
import sys
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from test_bench import run_tiny, table_rows

from ndjax.experiment import Experiment
from ndjax.hardware import gpu_target, roofline
from ndjax.ops import attention as attn
from ndjax.parallel.collectives import collectives, in_conditionals
from ndjax.parallel.mesh import AXES
from ndjax.planning import planner, traffic_bound
from ndjax.runtime import compiler
from ndjax.runtime.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_EXTRA = not gpu_target.missing()
needs_extra = pytest.mark.skipif(not HAVE_EXTRA, reason="needs the gpu-compile extra "
                                 "(pip install -e '.[gpu-compile]')")
H100 = roofline.HARDWARE["h100"]
MiB = 2**20


def _env():
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)


def _compile_cli(*args):
    return subprocess.run([sys.executable, "-m", "ndjax", "compile",
                           "--config=configs/llama_fsdp_tp.py", *args],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(HAVE_EXTRA, reason="checks the message of a machine without the extra")
def test_compile_without_the_extra_is_one_line():
    out = _compile_cli("--devices=8")
    assert out.returncode == 2, out
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install -e '.[gpu-compile]'" in lines[0], out.stderr


@needs_extra
@pytest.mark.parametrize("args, message", [
    (["train.py", "--config=configs/llama_fsdp.py", "--config.train.steps=-1"],
     "train.py: error: train.steps=-1 must be an int >= 0."),
    (["-m", "ndjax", "generate", "--prompt=hi"], "ndjax generate: error: --workdir="),
    (["-m", "ndjax", "export", "--out=hf"], "ndjax export: error: --workdir="),
    (["-m", "ndjax", "plan", "--config=configs/llama_fsdp.py", "--devices=0"],
     "ndjax plan: error: --devices=0 must be >= 1."),
], ids=["train", "generate", "export", "plan"])
def test_a_bad_value_is_one_line_where_the_extra_finds_no_gpu(tmp_path, args, message):
    """With the extra's CUDA plugin installed and JAX_PLATFORMS unset, on a machine
    without an NVIDIA GPU (CI's), a bad value is the program's one line and nothing
    else: no native "Could not find cuda drivers" lines, and no traceback of the
    plugin's failed check of the CUDA libraries (about 25 lines before the error)."""
    from jax._src import hardware_utils  # where jax looks for one before starting CUDA

    if hardware_utils.has_visible_nvidia_gpu():
        pytest.skip("a machine with an NVIDIA GPU: the plugin's check passes or says why")
    env = {k: v for k, v in _env().items()
           if k not in ("JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK")}
    workdir = [] if "plan" in args else [f"--workdir={tmp_path / 'run'}"]
    out = subprocess.run([sys.executable, *args, *workdir], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=300)
    assert out.returncode == 2, out.stdout
    assert len(out.stdout.splitlines()) == 1 and out.stdout.startswith(message), out.stdout


# ----- one layer's attention gradient ---------------------------------------------------------


def _layer_grad_temp(kernel, seq, heads=32, kv=8, d=128, dtype=jnp.bfloat16):
    """Temp bytes of one attention layer's gradient (batch 1), compiled for an H100."""
    return _layer_grad(kernel, seq, heads, kv, d, dtype).memory_analysis().temp_size_in_bytes


def _layer_grad(kernel, seq, heads=32, kv=8, d=128, dtype=jnp.bfloat16):
    """One attention layer's gradient (batch 1), compiled for an H100."""
    devices = gpu_target.devices(H100, 1)
    replicated = NamedSharding(Mesh(np.array(devices), ("x",)), PartitionSpec())
    q = jax.ShapeDtypeStruct((1, seq, heads, d), dtype, sharding=replicated)
    k = jax.ShapeDtypeStruct((1, seq, kv, d), dtype, sharding=replicated)
    seg = jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=replicated)

    def loss(q, k, v, seg):
        return kernel(q, k, v, seg).astype(jnp.float32).sum()

    with gpu_target.compiling_for(devices):
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, k, seg).lower().compile()


CFG = types.SimpleNamespace(attn_max_docs=64, attn_kv_tile=512)


@needs_extra
def test_cudnn_layer_memory_is_linear_and_near_plain_causal_cudnn():
    """The defect this fixed: room for seq_len documents per row made cuDNN's saved
    softmax statistics O(seq^2) (2,112 -> 33,024 MiB from 4096 to 16384 tokens)."""
    def packed(q, k, v, seg):
        return attn.KERNELS["cudnn"](q, k, v, seg, CFG)

    def plain(q, k, v, seg):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    short, long = (_layer_grad_temp(packed, s) for s in (4096, 16384))
    assert long / short <= 4.5, (short / MiB, long / MiB)
    assert long <= 2 * _layer_grad_temp(plain, 16384), long / MiB


@needs_extra
def test_cudnn_compiles_a_sliding_window_and_scale():
    """The layer's window reaches cuDNN's forward and backward as sliding_window_length
    (a token sees (pos - w, pos], HF's window), packed rows still PADDING_CAUSAL."""
    spec = attn.AttentionSpec(window=256, scale=0.1)
    text = _layer_grad(lambda q, k, v, seg: attn.KERNELS["cudnn"](q, k, v, seg, CFG, spec),
                       1024, heads=8, kv=2).as_text()
    calls = [line for line in text.splitlines() if "__cudnn$fmha" in line]
    assert len(calls) == 2, calls  # forward, backward
    for call in calls:
        assert all(f in call for f in ('"sliding_window_length": 256', '"fmha_scale": 0.1',
                                       '"mask_type": "PADDING_CAUSAL"')), call[-600:]


@needs_extra
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_pallas_compiles_for_every_head_dim(head_dim, dtype):
    """Blocks sized per head (ndjax.ops.attention.pallas_block_sizes): Gemma's 256 in
    float32 needs smaller ones than Llama's 128 in bfloat16 to fit shared memory."""
    temp = _layer_grad_temp(lambda q, k, v, seg: attn.pallas_attention(q, k, v, seg), 2048,
                            d=head_dim, dtype=dtype)
    assert temp > 0


# ----- the whole train step -----------------------------------------------------------------

SMALL = dict(vocab_size=4096, dim=512, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=1024,
             dtype="bfloat16", remat="full")


def _step_temp(impl, seq, mesh=None, model=None, hw="h100", step="train", rows=2):
    c = tiny_config(mesh=mesh or dict(fsdp=2), model={**SMALL, "attn_impl": impl,
                                                      **(model or {})},
                    train=dict(batch_size=rows, seq_len=seq))
    n = int(np.prod([c.mesh[a] for a in AXES]))
    exp = Experiment.from_config(c, gpu_target.devices(roofline.HARDWARE[hw], n))
    with warnings.catch_warnings():
        # An XLA option the GPU compiler does not know (compiler.compile_step).
        warnings.filterwarnings("error", message="XLA does not know the compile option")
        compiled = exp.compiled_step if step == "train" else exp.compiled_eval
    return exp, compiled


@needs_extra
@pytest.mark.parametrize("impl, mesh", [("cudnn", None), ("pallas", None), ("tiled", None),
                                        ("ring", dict(fsdp=1, context=2)),
                                        ("dense", None)])
def test_train_step_memory_against_the_sequence(impl, mesh):
    """4x the tokens: the linear kernels' step needs at most 4.5x the temporaries;
    dense's (seq x seq) scores are the control that this can tell them apart."""
    temps = [_step_temp(impl, seq, mesh)[1].memory_analysis().temp_size_in_bytes
             for seq in (2048, 8192)]
    ratio = temps[1] / temps[0]
    if impl == "dense":
        assert ratio > 8, temps
    else:
        assert ratio <= 4.5, (impl, [t / MiB for t in temps])


def _fmha_forwards(text: str) -> int:
    """cuDNN fused-attention forward calls in compiled HLO (the backward's target is
    ``__cudnn$fmhaSoftmaxBackward``), less the copies of a loop body that XLA's double
    buffering makes (two iterations a trip: each call once)."""
    return sum('custom_call_target="__cudnn$fmhaSoftmax"' in line
               and "double_buffer_clone" not in line for line in text.splitlines())


@needs_extra
@pytest.mark.parametrize("scan", [True])
def test_cudnn_runs_its_forward_once_a_layer_unless_remat_is_full(scan):
    """jax's cuDNN VJP saves its output and softmax statistics unnamed, so under every
    save_only_these_names policy the backward pass ran the forward again (2 fmha
    forwards a layer at remat=none); named through kernel_vjp, it runs once a layer
    but under full remat, as roofline.RERUN prices. Unrolled, each layer's call
    stands in the HLO; scanned, the forward scan's body holds one and the
    backward's one more where it reruns."""
    for remat in ("none", "save_attn", "full"):
        _, compiled = _step_temp("cudnn", 1024, model=dict(remat=remat, scan_layers=scan))
        rerun = "attention" in roofline.RERUN[remat]
        per_layer = _fmha_forwards(compiled.as_text()) / (1 if scan else SMALL["n_layers"])
        assert per_layer == (2 if rerun else 1), (remat, per_layer)


@needs_extra
def test_a_gemma_like_step_compiles_with_windowed_and_global_layers_for_a_gpu():
    """The train step of a model with local and global layers (Gemma 3's layout: here
    every 2nd layer global, one scanned period of 2; a query scalar), compiled
    for H100s with cuDNN: the local layers' calls carry their window, the global
    one's none, all with the query scalar's scale."""
    model = dict(family="gemma3", n_layers=2, head_dim=64, sliding_window=256,
                 sliding_window_pattern=2, query_pre_attn_scalar=100.0)
    exp, compiled = _step_temp("auto", 1024, model=model)
    assert exp.attention.name == "cudnn"
    calls = [line for line in compiled.as_text().splitlines() if "__cudnn$fmha" in line]
    windowed = [c for c in calls if '"sliding_window_length": 256' in c]
    assert calls and 0 < len(windowed) < len(calls), len(calls)
    assert all('"fmha_scale": 0.1' in c for c in calls)


@needs_extra
@pytest.mark.parametrize("mesh, dtype, want", [(dict(fsdp=2, context=2), "bfloat16", "cudnn"),
                                               (dict(context=2, tensor=2), "float32", "pallas")])
def test_all_to_all_runs_a_fused_kernel_under_context_parallelism(mesh, dtype, want):
    """On GPUs, auto splits the sequence with all-to-all (model.cp_impl) so that a fused
    kernel attends over the whole sequence for each device's heads: cuDNN's or
    Triton's custom calls inside, all-to-alls around them, no ring; and its memory
    stays linear in the sequence (context x tensor: 1 kv head a device, repeated)."""
    temps = []
    for seq in (2048, 8192):
        exp, compiled = _step_temp("auto", seq, mesh, model=dict(dtype=dtype))
        assert (exp.attention.cp, exp.attention.name) == ("all_to_all", want), exp.attention
        text = compiled.as_text()
        kernel = "__cudnn$fmha" if want == "cudnn" else "mha_forward"  # Pallas's kernel
        assert kernel in text and "all-to-all" in text and "collective-permute" not in text
        temps.append(compiled.memory_analysis().temp_size_in_bytes)
    assert temps[1] / temps[0] <= 4.5, [t / MiB for t in temps]


@needs_extra
@pytest.mark.parametrize("dtype, want", [("bfloat16", "cudnn"), ("float32", "pallas")])
def test_auto_on_a_gpu_picks_a_kernel_that_compiles(dtype, want):
    exp, compiled = _step_temp("auto", 1024, model=dict(dtype=dtype))
    assert exp.model_cfg.attn_impl == want
    assert "custom-call" in compiled.as_text()  # cuDNN's or Triton's kernel, not einsums


@needs_extra
def test_one_row_on_several_gpus_takes_pallas_and_compiles():
    """cuDNN's sharding rule fails for one row per micro-batch on several devices:
    auto takes Pallas there, and an explicit cudnn is refused before compiling."""
    exp, _ = _step_temp("auto", 512, mesh=dict(tensor=2), rows=1)
    assert exp.model_cfg.attn_impl == "pallas"
    with pytest.raises(ConfigError, match="one row per micro-batch"):
        c = tiny_config(mesh=dict(tensor=2), model={**SMALL, "attn_impl": "cudnn"},
                        train=dict(batch_size=2, seq_len=512, grad_accum=2))
        Experiment.from_config(c, gpu_target.devices(H100, 2))


@needs_extra
def test_the_kernels_bound_reaches_the_loader_of_a_gpu_run(tmp_path, monkeypatch):
    """model.attn_max_docs reaches the loader (train and eval) where cuDNN runs, so its
    rows are packed within it; no bound where the kernel needs none."""
    from ndjax.training import loop

    def config(impl):
        return tiny_config(mesh=dict(fsdp=2), model={**SMALL, "attn_impl": impl,
                                                     "attn_max_docs": 5},
                           train=dict(batch_size=2, seq_len=512, eval_every=1))

    got = []

    class Stop(Exception):
        pass

    def open_loader(*args, max_runs=None, **kwargs):
        got.append(max_runs)
        raise Stop  # the run goes no further than its data here

    monkeypatch.setattr(loop, "open_loader", open_loader)
    for impl in ("cudnn", "pallas"):
        exp = Experiment.from_config(config(impl), gpu_target.devices(H100, 2))
        assert exp.max_runs == (5 if impl == "cudnn" else None)
        with pytest.raises(Stop):
            loop.train(config(impl), str(tmp_path / impl), gpu_target.devices(H100, 2))
        with pytest.raises(Stop):
            loop._eval_batches(exp)
    assert got == [5, 5, None, None]


def _gathered(compiled):
    return sorted((c.kind, c.bytes, c.executed) for c in collectives(compiled.as_text())
                  if c.kind == "all-gather")


FSDP_TP = (("fsdp", 2), ("tensor", 2))


def _step_at(impl, mesh=FSDP_TP, window=None):
    """A step at 1024 tokens, compiled once per session: the skipping tests below share
    the pallas and tiled steps with the one above."""
    return _cached_step(impl, mesh, window)


@functools.cache
def _cached_step(impl, mesh, window):
    model = dict(family="mistral", sliding_window=window) if window else None
    return _step_temp(impl, 1024, dict(mesh), model=model)[1]


@needs_extra
def test_pallas_runs_on_each_devices_rows_and_heads():
    """A pallas_call has no partitioning rule: outside a shard_map XLA gathered the
    whole batch and every head onto each device around it. Now its step gathers
    what the tiled kernel's gathers (the weights), nothing more."""
    assert _gathered(_step_at("pallas")) == _gathered(_step_at("tiled"))


@needs_extra
@pytest.mark.parametrize("impl, mesh, window", [
    ("tiled", FSDP_TP, None),
    ("tiled", FSDP_TP, 256),   # a Mistral-like sliding window
    ("ring", (("context", 2), ("tensor", 2)), None),
], ids=["tiled", "tiled-window", "ring"])
def test_skipping_kernels_run_on_each_devices_rows_and_heads(impl, mesh, window):
    """The kernels that skip tiles, blocks or key ranges do it in conditionals (by
    documents, by window). Outside a shard_map manual over every mesh axis, XLA's
    partitioner gathered their operands inside them: 72 all-gathers in the tiled
    step's conditionals, 77 in the step (with or without a window), where pallas
    has 5 (the weights). Now no collective runs inside a conditional, and the step
    gathers what pallas's does: the weights, and for the ring (the weights over
    context instead of fsdp) the segment-id ranges of its key tiles, a few bytes.
    (blocked runs through the same per-device wrapper; it is never auto's choice on
    a GPU, and its step takes 40 s to compile.)"""
    compiled = _step_at(impl, mesh, window)
    text = compiled.as_text()
    assert "conditional(" in text
    assert not in_conditionals(text)
    if impl != "ring":
        assert _gathered(compiled) == _gathered(_step_at("pallas"))
        return
    # The ring's segment-id ranges may be combined with a weight's gather.
    extra = (sum(b for _, b, _ in _gathered(compiled))
             - sum(b for _, b, _ in _gathered(_step_at("pallas"))))
    assert 0 < extra <= 1024, extra


@needs_extra
def test_offload_keeps_each_layers_input_in_host_memory():
    """remat=offload compiled for H100s: XLA's host offloader keeps the layer inputs the
    scan saves in pinned host memory (S(5) in the HLO), exactly layers x the device's
    rows x seq x dim bf16, and the device holds that much less but a layer or two in
    flight. full, the same step otherwise, uses no host memory."""
    layers, seq = 8, 2048
    _, full = _step_temp("auto", seq, model=dict(remat="full", n_layers=layers))
    _, off = _step_temp("auto", seq, model=dict(remat="offload", n_layers=layers))
    f, m = full.memory_analysis(), off.memory_analysis()
    per_layer = 1 * seq * SMALL["dim"] * 2  # batch 2 over fsdp=2: one row per device
    assert m.host_temp_size_in_bytes == layers * per_layer
    assert f.host_temp_size_in_bytes == 0 and "S(5)" not in full.as_text()
    assert "S(5)" in off.as_text()
    assert m.argument_size_in_bytes == f.argument_size_in_bytes
    saved = f.temp_size_in_bytes - m.temp_size_in_bytes
    assert layers * per_layer - 2 * per_layer <= saved <= layers * per_layer, saved


@needs_extra
def test_gpu_compiler_options_are_known_to_the_gpu_compiler():
    chosen = compiler.options("gpu", {})
    assert chosen
    exp, compiled = _step_temp("auto", 512)
    # compile_step drops an unknown option with a warning; _step_temp makes that an
    # error, so reaching here means XLA's GPU compiler took every option.
    assert compiled.memory_analysis().temp_size_in_bytes > 0


@needs_extra
def test_eval_step_compiles_on_b200_and_a100():
    for hw in ("b200", "a100"):
        exp, compiled = _step_temp("auto", 512, hw=hw, step="eval")
        assert exp.model_cfg.attn_impl == ("cudnn" if hw == "b200" else "pallas"), hw


@needs_extra
def test_target_devices_span_nodes():
    devices = gpu_target.devices(H100, 16, per_node=8)
    assert len(devices) == 16 and devices[0].platform == "gpu"
    assert devices[0].compute_capability == "9.0"
    with pytest.raises(ConfigError, match=r"--devices=12 is not a whole number of nodes"):
        gpu_target.devices(H100, 12, per_node=8)


# ----- the command line -----------------------------------------------------------------------


@needs_extra
def test_compile_cli_json_for_llama3_8b_at_16k():
    """The issue's acceptance case: the fused kernels' step within 1.25x the tiled one's
    temporaries at 16,384 tokens (cudnn was 2.46x, with room for 16,384 documents)."""
    temps = {}
    for impl in ("cudnn", "pallas", "tiled"):
        out = _compile_cli("--hardware=h100", "--devices=8", "--json",
                           "--config.model.preset=llama3_8b", "--config.train.batch_size=8",
                           "--config.train.seq_len=16384", "--config.model.remat=full",
                           f"--config.model.attn_impl={impl}")
        assert out.returncode == 0, out.stderr
        r = json.loads(out.stdout)
        assert r["attention"] == impl and r["hardware"] == "h100" and r["devices"] == 8
        assert r["fits"] == (r["argument_bytes"] + r["temp_bytes"] <= 0.75 * 80e9)
        kinds = {c["kind"] for c in r["collectives"]}
        assert {"all-gather", "reduce-scatter", "all-reduce"} <= kinds, kinds
        temps[impl] = r["temp_bytes"]
    assert temps["cudnn"] <= 1.25 * temps["tiled"], temps
    assert temps["pallas"] <= 1.25 * temps["tiled"], temps


@needs_extra
@pytest.mark.parametrize("args, message", [
    (["--devices=8", "--hardware=h900"], "--hardware='h900': choose one of"),
    (["--devices=4"], "multiply to 8, but there are 4 devices"),
    (["--devices=12"], "--devices=12 is not a whole number of nodes"),
    (["--devices=8", "--step=predict"], "--step='predict': choose one of"),
    (["--devices=8", "--step=decode", "--max_new_tokens=4096", "--config.train.seq_len=4096"],
     "--max_new_tokens=4096 leaves no room for a prompt"),
])
def test_compile_cli_bad_input_is_one_line(args, message):
    out = _compile_cli(*args)
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
    assert out.stdout == ""


@needs_extra
def test_compile_cli_decode_compiles_prefill_and_the_decode_loop():
    out = _compile_cli("--hardware=h100", "--devices=8", "--json", "--step=decode",
                       "--max_new_tokens=32", "--config.train.seq_len=256")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["step"] == "decode" and set(r["programs"]) == {"prefill", "decode"}
    assert all(p["argument_bytes"] > 0 for p in r["programs"].values())
    worst = max(p["argument_bytes"] + p["temp_bytes"] for p in r["programs"].values())
    assert r["argument_bytes"] + r["temp_bytes"] == worst


@needs_extra
def test_compile_cli_counts_the_decode_loops_collectives_per_token():
    """The decode loop (a while loop that stops when every row has ended: no trip count
    in the HLO) the larger program, with FSDP's gathers in it: its collectives are counted
    per generated token (it raised a traceback)."""
    out = _compile_cli("--hardware=h100", "--devices=8", "--step=decode",
                       "--max_new_tokens=240", "--config.train.seq_len=256")
    assert out.returncode == 0, out.stderr
    assert "programs: prefill" in out.stdout and "collectives per generated token" in out.stdout
    assert "all-gather" in out.stdout, out.stdout


@needs_extra
def test_bench_gpu_cases_compile_for_an_h200():
    """Every case of bench/gpu.py compiles for the GPU it will first run on, and fits."""
    out = subprocess.run([sys.executable, "bench/gpu.py", "--compile_for=h200",
                          "--budget=1200"], cwd=ROOT, env=_env(), capture_output=True,
                         text=True, timeout=1500)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == 14, out.stdout
    # The numerics checks run on a GPU or not at all; every other case compiles.
    assert "skipped: cuDNN runs on a GPU only" in rows[0], out.stdout
    assert all("skipped: the Mosaic GPU kernels run on a GPU only" in row
               for row in rows[1:3]), out.stdout
    assert all("compiled for H200" in row for row in rows[3:]), out.stdout


# The bench scripts that compile for GPUs, at their smoke size (tests/test_bench.py runs
# the others): each must end with status 0 and print its table.


@needs_extra
def test_bench_compile_targets_tiny():
    """One layout, compiled by the CPU and the GPU compiler, side by side."""
    lines = run_tiny("compile_targets.py").stdout.splitlines()
    rows = table_rows(lines, "tiny")
    assert [r[3] for r in rows] == ["fsdp=4 x tensor=2"], lines
    cpu_gib, gpu_gib, ratio = rows[0][5], rows[0][7], rows[0][8]
    assert cpu_gib != "-" and gpu_gib != "-" and ratio.endswith("x"), rows


@needs_extra
def test_bench_long_context_tiny():
    """The ring and all-to-all of one long-context case, each compiled and priced."""
    lines = run_tiny("long_context.py").stdout.splitlines()
    rows = table_rows(lines, "llama3_8b")
    assert [r[6] for r in rows] == ["ring", "all_to_all"], lines
    assert all(len(r) == 15 and r[8] in ("yes", "no") for r in rows), rows  # no error rows


@needs_extra
def test_bench_families_tiny():
    lines = run_tiny("families.py").stdout.splitlines()
    rows = table_rows(lines, "llama", "gemma3")
    assert [r[:2] for r in rows] == [["llama", "tiny"], ["gemma3", "tiny"]], lines
    assert all(float(r[8]) >= 0 for r in rows), rows


@needs_extra
def test_bench_moe_layouts_tiny():
    """One compile through the experts' exchange in capacity mode, and the CPU part:
    dropless, capacity 1.25 and dense, each timed and its drops counted."""
    lines = run_tiny("moe_layouts.py").stdout.splitlines()
    (gpu,) = table_rows(lines, "tiny (all of 2 layers)")
    assert gpu[2:4] == ["fsdp=4 x expert=2", "1.25"] and float(gpu[9].replace(",", "")) > 0
    rows = table_rows(lines, "MoE, dropless", "MoE, capacity 1.25",
                      "dense, the MoE's active width")
    assert len(rows) == 3 and rows[0][3] == "0.0%" and rows[1][3] != "0.0%", rows


@needs_extra
def test_bench_pipeline_schedules_tiny():
    """No stages, and GPipe, the circular schedule and 1F1B gathering each stage's layers
    once, compiled for H100s and tabled with their ticks and bubbles."""
    lines = run_tiny("pipeline_schedules.py").stdout.splitlines()
    rows = table_rows(lines, "none", "GPipe, gathered once", "circular, gathered once",
                      "1F1B, gathered once")
    assert [r[1:5] for r in rows] == [["fsdp=8", "full", "-", "-"],
                                      ["stage=4 x fsdp=2", "none", "11", "27%"],
                                      ["stage=4 x fsdp=2", "none", "19", "16%"],
                                      ["stage=4 x fsdp=2", "none", "14", "27%"]], rows
    assert all(float(r[11].replace(",", "")) > 0 for r in rows), rows


@needs_extra
def test_bench_open_models_tiny():
    """GPT-OSS under LoRA over expert=8 (its sinks: no fused kernel, cuDNN and Pallas
    have none) and DeepSeek V3 (latent attention, a dense first layer) over expert x
    tensor, compiled for H100s and tabled."""
    lines = run_tiny("open_models.py").stdout.splitlines()
    rows = table_rows(lines, "tiny")
    assert [r[1] for r in rows] == ["LoRA r=16", "full"], lines
    assert rows[0][4] not in ("cudnn", "pallas") and all(float(r[8]) > 0 for r in rows), rows


@needs_extra
def test_bench_lora_tiny():
    """Full fine-tuning and LoRA compiled side by side, then timed on the CPU."""
    lines = run_tiny("lora.py").stdout.splitlines()
    full, lora, qlora = table_rows(lines, "tiny")
    assert (full[4], lora[4], qlora[4]) == ("full", "LoRA r=16", "QLoRA r=16, NF4"), lines
    # The NF4 base: over a quarter of the bfloat16 one (the scales, and the embeddings
    # and LM head, which stay bfloat16: a third of the tiny model), under a half.
    mib = [float(row[5].replace(",", "")) for row in (lora, qlora)]
    assert 0.25 < mib[1] / mib[0] < 0.5, (lora, qlora)
    # Adapters' optimizer state instead of the model's: less memory even at this size.
    assert lora[10].endswith("x") and float(lora[10][:-1]) < 1, lora
    assert len(table_rows(lines, "full fine-tuning", "LoRA r=16, all-linear")) == 2, lines


# ----- the experts' grouped matmuls (model.moe_impl) ------------------------------------------


@needs_extra
def test_the_mosaic_grouped_matmuls_keep_an_experts_gradient_grouped():
    """One grouped matmul's gradient at Qwen3-30B-A3B's size on one device of fsdp=8 at
    8 x 4096 tokens (32,768 token-expert rows, 2048 -> 768, 128 experts): XLA's GPU
    compiler turns ragged_dot into a dense matmul over every expert (22 GiB of
    temporaries); jax's Mosaic GPU kernels stay grouped (47 MiB measured)."""
    from ndjax.ops.grouped_matmul import grouped_matmul
    devices = gpu_target.devices(H100, 1)
    replicated = NamedSharding(Mesh(np.array(devices), ("x",)), PartitionSpec())
    m, k, n, groups = 32768, 2048, 768, 128

    def spec(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

    def temp(impl):
        def loss(x, w, sizes, dy):
            return jnp.sum(grouped_matmul(x, w, sizes, impl).astype(jnp.float32) * dy)
        with gpu_target.compiling_for(devices):
            compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(
                spec((m, k)), spec((groups, k, n)), spec((groups,), jnp.int32),
                spec((m, n), jnp.float32)).compile()
        return compiled.memory_analysis().temp_size_in_bytes
    mosaic, xla = temp("mosaic"), temp("xla")
    assert mosaic < 256 * MiB < 10 * 1024 * MiB < xla, (mosaic / MiB, xla / MiB)


MOE_SMALL = dict(family="qwen3_moe", vocab_size=4096, dim=512, n_layers=2, n_heads=8,
                 n_kv_heads=2, head_dim=64, ffn_dim=1024, moe_ffn_dim=256, n_experts=8,
                 experts_per_token=2, dtype="bfloat16")


def _mosaic_calls(text: str) -> int:
    return sum("custom-call(" in line and "mosaic_gpu" in line for line in text.splitlines())


@needs_extra
@pytest.mark.parametrize("remat, per_layer", [("none", 9), ("full", 12)])
def test_an_moe_step_runs_the_mosaic_kernels_on_each_devices_share(remat, per_layer):
    """auto picks the Mosaic GPU kernels on H100s. Per layer: 3 forward (gate, up,
    down), 6 backward (each one's rows' and weights' gradients), and under full remat
    the 3 forward again. fsdp x tensor: the MoE shard_map is manual over the experts'
    width too, so the step gathers exactly what ragged_dot's step gathers (left to the
    partitioner, the custom calls' weights were gathered whole: 42.6 MiB vs 18.6)."""
    def step(impl):
        c = tiny_config(mesh=dict(fsdp=2, tensor=2),
                        model=dict(MOE_SMALL, remat=remat, moe_impl=impl),
                        train=dict(batch_size=4, seq_len=1024))
        exp = Experiment.from_config(c, gpu_target.devices(H100, 4))
        return exp, exp.compiled_step.as_text()
    exp, text = step("auto")
    assert exp.model_cfg.moe_impl == "mosaic"
    assert _mosaic_calls(text) == per_layer * MOE_SMALL["n_layers"]
    if remat == "none":
        _, reference = step("xla")
        gathers = [sorted((c.kind, c.bytes) for c in collectives(t) if c.kind == "all-gather")
                   for t in (text, reference)]
        assert gathers[0] == gathers[1]


@needs_extra
def test_expert_parallelism_compiles_to_ragged_all_to_alls():
    """fsdp=2 x expert=2 on H100s: each layer's (token, expert) pairs go to their
    experts' devices and back in XLA's ragged-all-to-all (2 forward, their transposes
    2 backward), not in the all-gather that stands in for it on CPUs; the experts run
    as the Mosaic kernels, one chunk of the receive buffer at a time (lax.cond). Each
    is counted at the pairs a device has, not at the receive buffer's worst case. The
    model is Qwen 2 MoE's block: a shared expert beside the routed ones."""
    model = dict(MOE_SMALL, family="qwen2_moe", shared_expert_dim=1024, remat="none")
    c = tiny_config(mesh=dict(fsdp=2, expert=2), model=model,
                    train=dict(batch_size=4, seq_len=1024))
    devices = gpu_target.devices(H100, 4)
    exp = Experiment.from_config(c, devices)
    text = exp.compiled_step.as_text()
    # Asynchronous on GPUs (start/done pairs), in the scanned layers' loop bodies.
    ragged = sum(" ragged-all-to-all-start(" in line and "double_buffer_clone" not in line
                 for line in text.splitlines())
    assert ragged >= 4, ragged
    pairs = 4 * 1024 // 4 * MOE_SMALL["experts_per_token"]  # a device's (token, expert) rows
    counted = {c.bytes for c in collectives(text) if c.lowered_from == "ragged-all-to-all"}
    assert counted == {pairs * MOE_SMALL["dim"] * 2}, counted  # bf16 rows
    # The planner's least traffic counts them (4 a layer), and of every kind no more
    # than is compiled: the experts' float32 gradient sums of bfloat16 partials too,
    # which a GPU moves in float32 (not read as the CPU compiler's widening).
    least = traffic_bound.least_traffic(exp, devices, 8).inside
    sent = roofline.traffic(planner.collective_records(text, exp.mesh, devices), 8).inside
    assert least["all-to-all"] == 4 * MOE_SMALL["n_layers"] * counted.pop() / 2
    assert all(least[kind] <= sent[kind] for kind in least), (least, sent)
    # The CPU stand-in would all-gather every device's (pairs, dim) rows into a
    # (2, 2048, 512) buffer (a shape the chunked receive buffer has too, so the test
    # looks at what the all-gathers make, not at the shape anywhere in the text).
    assert not [line for line in text.splitlines()
                if "bf16[2,2048,512]" in line.split("=", 1)[-1].split("all-gather", 1)[0]
                and " all-gather" in line], "the pairs were all-gathered"
    assert exp.model_cfg.moe_impl == "mosaic" and _mosaic_calls(text) > 0


# The planner's least traffic against the GPU compiler's, on 8 H100s in nodes of 4:
# megatron_sp (its all-reduces as reduce-scatters and all-gathers), LoRA, stages over
# replicas and tensor (every tick runs the layers' collectives and the gradients'
# all-reduce, bubble ticks too). A narrow MLP-ful model at seq 1024, so the layers'
# collectives are most of the traffic. 2 layers by default; with 1 a stage XLA sums the
# gradients over replicas once a step, with 2 at every tick (traffic_bound counts both).
TRAFFIC_LAYOUTS = {
    "fsdp4_tensor2_megatron_sp": (dict(fsdp=4, tensor=2), {}, "megatron_sp"),
    "fsdp2_tensor4_lora": (dict(fsdp=2, tensor=4), {"lora": {"rank": 8, "alpha": 16.0}},
                           "default"),
    "stage2_replica2_tensor2": (dict(stage=2, replica=2, tensor=2), {}, "default"),
    "stage2_replica2_fsdp2_1f1b_4_layers": (
        dict(stage=2, replica=2, fsdp=2, pipeline_schedule="1f1b"), {"n_layers": 4},
        "default"),
}


@needs_extra
@pytest.mark.parametrize("layout", list(TRAFFIC_LAYOUTS))
def test_the_least_traffic_is_below_the_gpu_compilers(layout):
    """Inside the nodes and across them, ``traffic_bound.least_traffic`` is at most what
    the compiled step sends; without stages the layers' weights are gathered exactly as
    often as it counts (twice: again in the backward pass, under every remat policy)."""
    mesh, model, rules = TRAFFIC_LAYOUTS[layout]
    c = tiny_config(mesh=mesh, model=dict(dim=512, n_heads=8, n_kv_heads=4, head_dim=64,
                                          ffn_dim=1024, vocab_size=4096, dtype="bfloat16",
                                          **model),
                    train=dict(batch_size=8, seq_len=1024))
    c.rules = rules
    if "stage" in mesh:
        c.train.microbatches = 4 if mesh.get("fsdp", 1) == 1 else 2
    devices = gpu_target.devices(H100, 8, 4)
    exp = Experiment.from_config(c, devices)
    least = traffic_bound.least_traffic(exp, devices, 4)
    sent = roofline.traffic(planner.collective_records(exp.compiled_step.as_text(),
                                                       exp.mesh, devices), 4)
    for side in ("inside", "across"):
        bound, compiled = getattr(least, side), getattr(sent, side)
        assert sum(bound.values()) <= sum(compiled.values()), (side, bound, compiled)
    if "stage" not in mesh and rules == "default":
        gathered = [link.inside.get("all-gather", 0) + link.across.get("all-gather", 0)
                    for link in (least, sent)]
        assert gathered[0] == pytest.approx(gathered[1], rel=0.05), gathered


@needs_extra
def test_preference_memory_tiny():
    """bench/preference_memory.py: sft and dpo compiled for 8 H100s, dpo's arguments
    holding the reference beside the state at exactly the trained weights' bytes."""
    lines = run_tiny("preference_memory.py").stdout.splitlines()
    rows = table_rows(lines, "sft", "dpo")
    assert [r[:3] for r in rows] == [["sft", "full", "none"], ["dpo", "full", "held"]], lines
    sft, dpo = rows
    # columns: weights, optimizer, held reference, batch, arguments (MiB)
    assert float(sft[5]) == 0 and float(dpo[5]) == float(dpo[3]) > 0, rows
    assert float(dpo[7]) > float(sft[7]), rows
    assert table_rows(lines, "dpo / sft")[0][1] == "full", lines


@needs_extra
def test_grpo_memory_tiny():
    """bench/grpo_memory.py: the sampler's prefill and decode loop and the GRPO step
    compiled for 8 H100s; the decode loop updates the cache it is given in place, the
    held reference (grpo.beta > 0) sits in the step's arguments at the weights' bytes,
    and the peak is the resident state plus the largest program's addition."""
    lines = run_tiny("grpo_memory.py").stdout.splitlines()
    programs = [r for r in table_rows(lines, "full") if len(r) == 10]
    assert [r[:4] for r in programs] == [["full", "0.04", "held", p] for p in (
        "sampler prefill", "sampler decode", "train step")], lines
    prefill, decode, _ = programs
    cache = float(prefill[6].split()[0])
    assert cache > 0 and decode[6] == f"{prefill[6].split()[0]} ({prefill[6].split()[0]})", \
        programs  # the decode loop's output: the cache, aliased to its donated argument
    (peak,) = [r for r in table_rows(lines, "full") if len(r) == 14]
    weights, reference, kv = float(peak[2]), float(peak[4]), float(peak[6])
    assert reference == weights > 0 and kv == cache, peak
    adds = [float(x.strip("*")) for x in peak[8:11]]
    assert abs(float(peak[11]) - (float(peak[7]) + max(adds))) <= 0.02, peak
    (gathers,) = [r for r in table_rows(lines, "full") if len(r) == 5]
    assert float(gathers[1]) > 0, gathers  # decode gathers the weights for every token


# ----- pipeline stages (mesh.stage) ------------------------------------------------------


@needs_extra
def test_pipeline_stages_compile_for_h100s_with_pallas_attention():
    """stage=2 x fsdp=2 on H100s: the stages' layers vmapped over ``stage`` compile with
    the GPU's kernels: Pallas attention (cuDNN's vmap rule is broken, so auto refuses it
    inside stages) in its shard_map, whose gradient recomputes its forward; the stream
    moves between the stages in collective permutes of one micro-batch's activations."""
    c = tiny_config(mesh=dict(stage=2, fsdp=2), model=dict(n_layers=4, remat="full"),
                    train=dict(batch_size=8, seq_len=512, microbatches=2))
    exp = Experiment.from_config(c, gpu_target.devices(H100, 4))
    assert exp.attention.name == "pallas" and exp.model_cfg.stages == 2
    permutes = {x.bytes for x in collectives(exp.compiled_step.as_text())
                if x.kind == "collective-permute"}
    rows = 8 // 2 // 2  # a micro-batch's rows on one fsdp shard
    assert rows * 512 * exp.model_cfg.dim * 2 in permutes, permutes  # bf16 stream
    # The circular schedule (2 chunks a stage) compiles with the same kernels and stream.
    c.mesh.virtual_stages = 2
    circular = Experiment.from_config(c, gpu_target.devices(H100, 4))
    assert circular.attention.name == "pallas" and circular.model_cfg.virtual_stages == 2
    assert rows * 512 * exp.model_cfg.dim * 2 in {
        x.bytes for x in collectives(circular.compiled_step.as_text())
        if x.kind == "collective-permute"}
    c.mesh.virtual_stages = 1
    with pytest.raises(ConfigError, match=r"cannot run inside pipeline stages \(mesh.stage=2\)"):
        c.model.attn_impl = "cudnn"
        Experiment.from_config(c, gpu_target.devices(H100, 4))
    # Nor can the Mosaic grouped matmuls (jax fails to batch them over the stages):
    # auto takes ragged_dot there, and an explicit choice is one line.
    c.model.update(dict(MOE_SMALL, attn_impl="auto", dtype="bfloat16"))
    moe = Experiment.from_config(c, gpu_target.devices(H100, 4))
    assert moe.model_cfg.moe_impl == "xla"
    with pytest.raises(ConfigError, match=r"^model.moe_impl='mosaic': they cannot run inside "
                                          r"pipeline stages \(mesh.stage=2\)"):
        c.model.moe_impl = "mosaic"
        Experiment.from_config(c, gpu_target.devices(H100, 4))
