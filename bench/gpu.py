"""Train-step speed and memory on one GPU: tokens/s, TFLOP/s, MFU, peak memory.

Cases, in priority order (a time budget skips the tail, and says so):

0. cuDNN's numbers: ``model.attn_impl=cudnn`` against ``dense`` in float32 on packed
   rows of bfloat16 (grouped-query heads; no window, and a window with a scale), the
   output and the q, k, v gradients, max abs error each. Only a GPU runs cuDNN, and
   the CPU tests check ndjax's side of it against a plain statement of its semantics,
   so this is the first check of the numbers it computes.
   Then the experts' grouped matmuls (``model.moe_impl=mosaic``, jax's Mosaic GPU
   kernels) in bfloat16 against ``jax.lax.ragged_dot`` in float32 at one Qwen3-30B-A3B
   layer's size, beside ragged_dot's own bfloat16 error: the product and both
   gradients; then capacity mode's shape, a quarter of the rows in no group (NaN)
   and half the experts empty, with the NaN count and the largest value past the
   groups (both must be 0). CPU tests run the kernels in Mosaic GPU's interpreter;
   their numbers on Hopper are unchecked until this runs.
1. ``llama3_1b`` shape, bfloat16, seq 4096, ``model.attn_impl=auto``: remat none,
   save_proj and full, each at the largest batch of its ladder that fits.
2. The attention kernels side by side on that shape (remat save_proj, batch 4):
   dense, tiled, cudnn, pallas.
3. A Llama 3 8B-shaped model with 8 of its 32 layers (all of the 8B's widths and its
   vocabulary), remat full, the largest batch that fits.
4. A Qwen3-30B-A3B-shaped MoE with 2 of its 48 layers (every width, 128 experts, its
   vocabulary), remat full: ``model.moe_impl`` mosaic at the largest batch that fits,
   then ragged_dot at batch 1 (its dense matmul over all experts).
5. ``llama3_1b`` at seq 8192, if time is left.

Each case runs in its own process, so that every peak-memory figure starts from
zero. A batch "fits" when the compiled step's planned memory (arguments +
temporaries, ``compiled.memory_analysis()``) is within 92% of the device's
limit; the largest of the ladder that fits is timed. Timing: two steps to warm
up, then ``--steps`` steps, synchronised on the loss. TFLOP/s counts model FLOPs
(``ndjax.hardware.flops``: 6 x parameters + attention, causal), MFU against the device's
dense bf16 peak (H200: 989 TFLOP/s).

    python bench/gpu.py                         # on the GPU machine, about 7 minutes
    python bench/gpu.py --write gpu_results.md  # also write the table and its context
    PYTHONPATH=. python bench/gpu.py --tiny     # CPU smoke run: tiny shapes, seconds
    PYTHONPATH=. python bench/gpu.py --compile_for=h200   # no GPU: each case compiled for
                                                          # one (pip install -e '.[gpu-compile]')

``--compile_for`` runs nothing: each case is compiled by XLA's GPU compiler for one
GPU of that kind (``ndjax.hardware.gpu_target``), with the GPU's memory (at
XLA_PYTHON_CLIENT_MEM_FRACTION, 0.95 here) as the limit, and its planned memory
reported, so that the first GPU at hand runs every case without a surprise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30
FIT = 0.92

ONE_B = dict(preset="llama3_1b", dtype="bfloat16")
EIGHT_B_8_LAYERS = dict(preset="llama3_8b", dtype="bfloat16", n_layers=8)
TINY = dict(preset="tiny", dtype="float32", n_layers=2, vocab_size=512, dim=128,
            n_heads=4, n_kv_heads=2, ffn_dim=256)


NUMERICS = dict(name="cudnn vs dense", kind="numerics", model=dict(attn_impl="cudnn"),
                seq=1024)
GROUPED = dict(name="mosaic vs ragged_dot", kind="numerics", check="grouped", seq=4096)
# Capacity mode's shape: a quarter of the rows in no group (NaN), half the experts none.
GROUPED_PAST = dict(GROUPED, name="mosaic vs ragged_dot, 75% of rows in groups", in_groups=0.75)
MOE_2_LAYERS = dict(family="qwen3_moe", preset="qwen3_30b_a3b", dtype="bfloat16", n_layers=2,
                    remat="full")


def cases(tiny: bool) -> list[dict]:
    """Each: name, model overrides, seq_len, batch ladder (largest first)."""
    if tiny:  # one case per code path: auto, an explicit kernel, a refused kernel
        kernels = [dict(name=f"kernel {k}", model=dict(TINY, remat="full", attn_impl=k),
                        seq=256, ladder=[2]) for k in ("tiled", "cudnn")]
        return [NUMERICS, GROUPED, dict(name="remat none", model=dict(TINY, remat="none"), seq=128,
                               ladder=[8, 4]), *kernels]
    remats = [dict(name=f"1b remat {r}", model=dict(ONE_B, remat=r), seq=4096, ladder=ladder)
              for r, ladder in (("none", [16, 8, 4]), ("save_proj", [24, 16, 8]),
                                ("full", [48, 32, 16]))]
    kernels = [dict(name=f"1b kernel {k}", model=dict(ONE_B, remat="save_proj", attn_impl=k),
                    seq=4096, ladder=[4]) for k in ("cudnn", "pallas", "tiled", "dense")]
    eight = dict(name="8b-shape 8 layers", model=dict(EIGHT_B_8_LAYERS, remat="full"), seq=4096,
                 ladder=[16, 8, 4])
    long = dict(name="1b seq 8192", model=dict(ONE_B, remat="full"), seq=8192, ladder=[16, 8])
    moe = [dict(name=f"30b-a3b-shape 2 layers {impl}", model=dict(MOE_2_LAYERS, moe_impl=impl),
                seq=4096, ladder=ladder) for impl, ladder in (("mosaic", [8, 4, 1]),
                                                              ("xla", [1]))]
    return [NUMERICS, GROUPED, GROUPED_PAST, *remats, *kernels, eight, *moe, long]


def packed_segments(rows: int, seq: int, seed: int = 0):
    """Segment ids of rows packed with documents of 1-300 tokens, each row's tail
    padding (id 0), as the packers make them."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = np.zeros((rows, seq), np.int32)
    for r in range(rows):
        pos, doc = 0, 1
        while pos < seq - 64:
            n = int(rng.integers(1, 300))
            out[r, pos:pos + n] = doc
            pos, doc = pos + n, doc + 1
    return out


def kernel_numerics(impl: str, seq: int, heads: int = 8, kv_heads: int = 2,
                    head_dim: int = 128) -> dict:
    """Max abs error of kernel ``impl``'s output and q, k, v gradients in bfloat16
    against ``dense`` in float32, on packed rows (grouped-query heads) with no window
    and with a window of 256 and a scale of 0.1 (cudnn on a GPU; the tests run it
    with a CPU kernel, smaller)."""
    import jax
    import jax.numpy as jnp

    from ndjax.ops import attention as attn

    seg = jnp.asarray(packed_segments(2, seq))
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (2, seq, heads, head_dim), jnp.float32)
    k, v = (jax.random.normal(key, (2, seq, kv_heads, head_dim), jnp.float32)
            for key in keys[1:3])
    d_out = jax.random.normal(keys[3], q.shape, jnp.float32)
    cfg = type("Cfg", (), dict(attn_max_docs=64, attn_kv_tile=128, cp_layout="zigzag"))
    errors = {}
    for label, spec in (("causal", attn.AttentionSpec()),
                        ("window 256 scale 0.1", attn.AttentionSpec(window=256, scale=0.1))):
        def run(kernel, dtype, spec=spec):
            def f(q, k, v):
                return kernel(q.astype(dtype), k.astype(dtype), v.astype(dtype), seg, spec)
            out, pullback = jax.vjp(f, q, k, v)
            return [x.astype(jnp.float32) for x in (out, *pullback(d_out.astype(out.dtype)))]

        got = jax.jit(lambda: run(lambda *a: attn.KERNELS[impl](*a[:4], cfg, a[4]),
                                  jnp.bfloat16))()
        want = jax.jit(lambda: run(attn.dense, jnp.float32))()
        errors[label] = {name: float(jnp.abs(g - w).max())
                         for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)}
    return errors


def grouped_numerics(rows: int = 32768, dim: int = 2048, width: int = 768,
                     experts: int = 128, impl: str = "mosaic", in_groups: float = 1.0) -> dict:
    """Max abs error of ``impl``'s grouped matmul in bfloat16 (the product, the rows'
    and the weights' gradients) against ``jax.lax.ragged_dot`` in float32, and of
    ragged_dot's own bfloat16 beside it, each over the float32 result's largest
    magnitude; tokens routed at random (uneven groups), as one Qwen3-30B-A3B layer's
    gate projection on one device of fsdp=8 at 8 x 4096 tokens by default.

    ``in_groups`` < 1: capacity mode's shape, the rows past that share in no group and
    NaN in x and dy, every odd expert's group empty. Then also ``nan``, the values that
    are not finite in the three results, and ``past``, the largest |value| of the
    product and the rows' gradient past the groups: both 0 where the kernels keep
    ndjax.ops' contract (the float32 reference gets those rows as zeros)."""
    import jax
    import jax.numpy as jnp

    from ndjax.ops.grouped_matmul import grouped_matmul

    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (rows, dim), jnp.float32)
    w = jax.random.normal(keys[1], (experts, dim, width), jnp.float32) / dim ** 0.5
    dy = jax.random.normal(keys[2], (rows, width), jnp.float32)
    chosen = jax.random.randint(keys[3], (rows,), 0, experts)
    filled = int(rows * in_groups)
    if filled < rows:
        chosen = chosen // 2 * 2
        x, dy = x.at[filled:].set(jnp.nan), dy.at[filled:].set(jnp.nan)
    sizes = jnp.zeros((experts,), jnp.int32).at[chosen[:filled]].add(1)

    def run(impl, dtype, x, dy):
        def f(x, w):
            return grouped_matmul(x.astype(dtype), w.astype(dtype), sizes, impl)
        out, pullback = jax.vjp(f, x, w)
        return [a.astype(jnp.float32) for a in (out, *pullback(dy.astype(out.dtype)))]

    want = jax.jit(lambda: run("xla", jnp.float32, jnp.nan_to_num(x), jnp.nan_to_num(dy)))()
    errors = {}
    for label, got in ((impl, jax.jit(lambda: run(impl, jnp.bfloat16, x, dy))()),
                       ("ragged_dot bf16", jax.jit(lambda: run("xla", jnp.bfloat16, x, dy))())):
        errors[label] = {name: float(jnp.abs(g - r).max() / jnp.abs(r).max())
                         for name, g, r in zip(("out", "dx", "dw"), got, want)}
        if filled < rows:
            errors[label]["nan"] = int(sum(jnp.sum(~jnp.isfinite(g)) for g in got))
            errors[label]["past"] = float(max(jnp.abs(g[filled:]).max() for g in got[:2]))
    return errors


# ----- one case, in its own process -----------------------------------------------------------


def _experiment(case: dict, batch: int, devices: list):
    from ndjax.config import default_config
    from ndjax.experiment import Experiment

    c = default_config()
    c.model.update(case["model"])
    c.mesh.update(dict(replica=1, fsdp=1, context=1, tensor=1))
    c.data.source = "synthetic"
    c.train.update(dict(batch_size=batch, seq_len=case["seq"], warmup_steps=0,
                        schedule="constant", steps=10))
    return Experiment.from_config(c, devices=devices)


def run_case(case: dict, steps: int) -> dict:
    import jax

    from ndjax.data.synthetic import SyntheticSource
    from ndjax.hardware import flops
    from ndjax.runtime.errors import ConfigError

    target = case.get("compile_for")
    if case.get("kind") == "numerics" and case.get("check") == "grouped":
        row = dict(name=case["name"], attention="-", seq=case["seq"])
        if target or jax.default_backend() != "gpu":
            return dict(row, note="skipped: the Mosaic GPU kernels run on a GPU only")
        errors = grouped_numerics(in_groups=case.get("in_groups", 1.0))
        return dict(row, device=jax.devices()[0].device_kind, errors=errors, note="max abs "
                    "error over the f32 result's largest (bf16 vs f32 ragged_dot): " + "; ".join(
                        f"{label}: " + ", ".join(f"{n} {e:.3g}" for n, e in errs.items())
                        for label, errs in errors.items()))
    if case.get("kind") == "numerics":
        row = dict(name=case["name"], attention="cudnn", seq=case["seq"])
        if target or jax.default_backend() != "gpu":
            return dict(row, note="skipped: cuDNN runs on a GPU only")
        errors = kernel_numerics("cudnn", case["seq"])
        return dict(row, device=jax.devices()[0].device_kind, errors=errors, note="max abs "
                    "error (bf16 cudnn vs f32 dense): " + "; ".join(
                        f"{label}: " + ", ".join(f"{n} {e:.2e}" for n, e in errs.items())
                        for label, errs in errors.items()))
    if target:
        from ndjax.hardware import gpu_target

        hw = gpu_target.hardware(target)
        devices = gpu_target.devices(hw, 1)
        limit = float(os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"]) * hw.memory_bytes
    else:
        devices = jax.devices()[:1]
        limit = (devices[0].memory_stats() or {}).get("bytes_limit")
    device = devices[0]
    row = dict(name=case["name"], seq=case["seq"], remat=case["model"].get("remat"),
               device=device.device_kind)
    t0 = time.perf_counter()
    exp = compiled = planned = batch = None
    for batch in case["ladder"]:  # the first (largest) that fits, else the last
        try:
            exp = _experiment(case, batch, devices)
        except ConfigError as e:
            return dict(row, attention=case["model"].get("attn_impl", "auto"),
                        note=f"refused: {e}")
        compiled = exp.compiled_step
        m = compiled.memory_analysis()
        planned = m.argument_size_in_bytes + m.temp_size_in_bytes
        if limit is None or planned <= FIT * limit:
            break
    row.update(batch=batch, attention=exp.model_cfg.attn_impl, planned_gib=planned / GiB,
               compile_s=time.perf_counter() - t0)
    if limit is not None and planned > FIT * limit:
        return dict(row, note=f"does not fit: plans {planned / GiB:.1f} of "
                    f"{limit / GiB:.1f} GiB")
    if target:
        m = compiled.memory_analysis()
        return dict(row, args_gib=m.argument_size_in_bytes / GiB,
                    temp_gib=m.temp_size_in_bytes / GiB,
                    note=f"compiled for {hw.name}, not run (of {limit / GiB:.1f} GiB)")
    source = SyntheticSource(exp.model_cfg.vocab_size, case["seq"], 0, max_runs=exp.max_runs)
    batch_arrays = exp.device_batch(source.rows(0, 0, batch))
    state = exp.init_state()
    for _ in range(2):
        state, metrics = compiled(state, batch_arrays)
    float(metrics["loss"])
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = compiled(state, batch_arrays)
    loss = float(metrics["loss"])
    seconds = (time.perf_counter() - start) / steps
    tokens = batch * case["seq"]
    tflops = flops.flops_per_token(exp.model_cfg, case["seq"]) * tokens / seconds / 1e12
    peak = flops.peak_tflops(device.device_kind)
    peak_bytes = (device.memory_stats() or {}).get("peak_bytes_in_use")
    return dict(row, step_ms=seconds * 1e3, tokens_per_s=tokens / seconds, tflops=tflops,
                mfu=tflops / peak if peak else None, loss=loss,
                peak_gib=peak_bytes / GiB if peak_bytes else None)


# ----- the table ------------------------------------------------------------------------------


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(rows: list[dict]) -> list[str]:
    if any("temp_gib" in r for r in rows):  # --compile_for: memory only, nothing timed
        lines = ["| case | attention | seq | batch | arguments GiB | temporaries GiB | "
                 "planned GiB | compile s | note |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['name']} | {r.get('attention', '-')} | {r.get('seq', '-')} | "
                  f"{r.get('batch', '-')} | {_cell(r.get('args_gib'), '.1f')} | "
                  f"{_cell(r.get('temp_gib'), '.1f')} | {_cell(r.get('planned_gib'), '.1f')} | "
                  f"{_cell(r.get('compile_s'), '.0f')} | {r.get('note', '')} |" for r in rows]
        return lines
    lines = ["| case | attention | seq | batch | step ms | tokens/s | TFLOP/s | MFU | "
             "peak GiB | planned GiB | compile s | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mfu = None if r.get("mfu") is None else 100 * r["mfu"]
        lines.append(
            f"| {r['name']} | {r.get('attention', '-')} | {r.get('seq', '-')} | "
            f"{r.get('batch', '-')} | {_cell(r.get('step_ms'), '.1f')} | "
            f"{_cell(r.get('tokens_per_s'), ',.0f')} | {_cell(r.get('tflops'), '.1f')} | "
            f"{_cell(mfu, '.1f')}{'%' if mfu is not None else ''} | "
            f"{_cell(r.get('peak_gib'), '.1f')} | {_cell(r.get('planned_gib'), '.1f')} | "
            f"{_cell(r.get('compile_s'), '.0f')} | {r.get('note', '')} |")
    return lines


def _compile_case(case: dict, steps: int) -> dict:
    """``run_case`` of a --compile_for case in this process: a case XLA cannot compile is
    a row of its own, as in a process of its own."""
    from ndjax.runtime.console import native_stderr

    try:
        with native_stderr(echo=False):
            return run_case(case, steps)
    except Exception as e:  # noqa: BLE001 -- the sweep goes on to the next case
        first = (str(e).strip().splitlines() or [""])[0][:160]
        return dict(name=case["name"], note=f"failed: {type(e).__name__}: {first}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shapes")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for all cases (default 450; 300 with --tiny)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per case")
    parser.add_argument("--write", default=None, help="also write the table here (Markdown)")
    parser.add_argument("--compile_for", default=None, metavar="HARDWARE",
                        help="no GPU: compile each case for one of these (h100, h200, ...)")
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one case, as JSON
    args = parser.parse_args()
    steps = args.steps or (2 if args.tiny else 5)
    if args.case:
        print("RESULT " + json.dumps(run_case(json.loads(args.case), steps)), flush=True)
        return

    # `python bench/gpu.py` on a GPU machine needs no PYTHONPATH (its cases get ROOT).
    sys.path.insert(0, ROOT)
    from ndjax.runtime.children import stop_children_on_signals

    stop_children_on_signals()  # a stopped sweep stops the case it waits on
    budget = args.budget or (300 if args.tiny else 450)
    start = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               XLA_PYTHON_CLIENT_MEM_FRACTION=os.environ.get(
                   "XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95"))
    if args.tiny or args.compile_for:
        env["JAX_PLATFORMS"] = "cpu"
    if args.compile_for:
        # Nothing runs on a device: the cases compile one after another in this process
        # (a process each would start jax and the CUDA plugin again each time).
        os.environ.update(JAX_PLATFORMS="cpu", XLA_PYTHON_CLIENT_MEM_FRACTION=env[
            "XLA_PYTHON_CLIENT_MEM_FRACTION"])
    rows = []
    for case in cases(args.tiny):
        if args.compile_for:
            case = dict(case, compile_for=args.compile_for)
        left = budget - (time.perf_counter() - start)
        if left < (10 if args.tiny else 60):
            rows.append(dict(name=case["name"], note="skipped: time budget spent"))
            continue
        if args.compile_for:
            rows.append(_compile_case(case, steps))
        else:
            cmd = [sys.executable, os.path.abspath(__file__), "--case", json.dumps(case),
                   "--steps", str(steps)]
            try:
                out = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                     timeout=left)
            except subprocess.TimeoutExpired:
                rows.append(dict(name=case["name"], note=f"timed out after {left:.0f} s"))
                continue
            result = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
            if out.returncode or not result:
                tail = (out.stderr.strip().splitlines() or ["no output"])[-1][:160]
                rows.append(dict(name=case["name"],
                                 note=f"failed (exit {out.returncode}): {tail}"))
            else:
                rows.append(json.loads(result[-1][len("RESULT "):]))
        print(f"{case['name']}: {rows[-1].get('note') or 'ok'}", file=sys.stderr, flush=True)

    import jax

    device = next((r["device"] for r in rows if r.get("device")), None) or (
        platform.processor() or "cpu")
    if args.compile_for:
        device = f"a CPU machine ({platform.machine()}, no GPU), compiled for {device}"
    flags_used = (" --tiny" if args.tiny else "") + (
        f" --compile_for={args.compile_for}" if args.compile_for else "")
    header = [f"`python bench/gpu.py{flags_used}` on {device}, "
              f"jax {jax.__version__}, {datetime.date.today().isoformat()}, "
              f"{time.perf_counter() - start:.0f} s", ""]
    lines = header + table(rows)
    if args.write:
        with open(args.write, "w") as f:
            f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
