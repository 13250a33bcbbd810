"""Every bench/*.py at its smoke size (``--tiny``), so that a script behind a
BENCHMARKS.md figure that stops running shows up here, not at the next rerun.

The scripts that compile for GPUs (the gpu-compile extra) have theirs in
tests/test_gpu_compile.py, which CI runs once the extra is installed.

Each runs as its BENCHMARKS.md command does: a fresh process, from the repo root, with
the repo on PYTHONPATH. Nothing is timed; the checks are that it ends with exit
status 0 and prints its result table.
"""

import os
import subprocess
import sys

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_tiny(script: str) -> subprocess.CompletedProcess:
    """``bench/<script> --tiny``, finished; fails the test on a non-zero exit."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    # The timeout only keeps a hung script from stalling the suite.
    out = subprocess.run([sys.executable, f"bench/{script}", "--tiny"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def table_rows(lines: list[str], *starts: str) -> list[list[str]]:
    """The cells of the table rows whose text begins with ``| start |`` for each start."""
    prefixes = tuple(f"| {s} |" for s in starts)
    return [[c.strip() for c in line.strip("|").split("|")]
            for line in lines if line.startswith(prefixes)]


def test_every_bench_script_has_a_smoke_run():
    """A new script without one would rot unnoticed (issue 33: two had none)."""
    tests = "".join(open(os.path.join(ROOT, "tests", name)).read()
                    for name in ("test_bench.py", "test_gpu_compile.py"))
    scripts = sorted(n for n in os.listdir(os.path.join(ROOT, "bench")) if n.endswith(".py"))
    assert [s for s in scripts if f'run_tiny("{s}")' not in tests] == []


def test_memory_tiny():
    """bench/memory.py, the script behind BENCHMARKS.md's memory table."""
    rows = [line for line in run_tiny("memory.py").stdout.splitlines()
            if line.startswith("| smoke")]
    # One row of each kind: bf16 without and with remat (its bound), bf16 parameters
    # and moments, and the tiled kernel.
    assert [r.split("|")[8].strip() for r in rows] == ["none", "full", "none", "full"], rows


def test_compile_time_tiny():
    lines = run_tiny("compile_time.py").stdout.splitlines()
    rows = table_rows(lines, "2")
    assert [r[1] for r in rows] == ["True", "False"], lines
    assert any(line.startswith("scanned 2 vs 2 layers: compile ratio") for line in lines), lines


def test_context_parallel_tiny():
    lines = run_tiny("context_parallel.py").stdout.splitlines()
    i = lines.index(next(x for x in lines if x.startswith("### 2.")))
    j = lines.index(next(x for x in lines if x.startswith("### 2b.")))
    memory, balance, packed = lines[:i], lines[i:j], lines[j:]
    assert [r[:3] for r in table_rows(memory, "1", "2")] == [
        ["1", "dense", "-"], ["1", "ring", "zigzag"], ["2", "ring", "zigzag"],
        ["2", "ring", "contiguous"]], lines
    # The ring sends exactly the K/V blocks its design says: with remat=none the
    # backward pass reuses the forward's saved output and log-sum-exp instead of
    # running the forward ring again.
    for row in table_rows(memory, "1", "2"):
        assert row[6].split()[0] == row[7], row
    # Blocks per shard are counted, not measured, so they are exact even at 64 tokens:
    # zigzag balanced (2c+1 each), contiguous growing with the shard index.
    assert [r[:3] for r in table_rows(balance, "1", "2")] == [
        ["1", "zigzag", "[3]"], ["1", "contiguous", "[4]"],
        ["2", "zigzag", "[5, 5]"], ["2", "contiguous", "[4, 8]"]], lines
    # Document-aware skipping: a packed row of short documents computes fewer tile
    # pairs than the same row as one document, at each context degree.
    rows = table_rows(packed, "1", "2")
    assert [r[:2] for r in rows] == [["1", "one doc"], ["1", "packed"], ["2", "one doc"],
                                     ["2", "packed"]], lines
    for whole, docs in (rows[:2], rows[2:]):
        assert int(docs[5]) < int(whole[5]), (whole, docs)


def test_doc_skipping_tiny():
    """Each kernel timed on one document and on packed rows; the packed rows' work,
    counted as the kernel ran, is below one document's (the timing is not checked)."""
    lines = run_tiny("doc_skipping.py").stdout.splitlines()
    rows = table_rows(lines, "blocked", "tiled", "ring c=4")
    assert [r[:3] for r in rows] == [[k, s, r] for k, s in (("blocked", "256"), ("tiled", "512"),
                                                            ("ring c=4", "512"))
                                     for r in ("one doc", "packed")], lines
    for whole, docs in zip(rows[::2], rows[1::2]):
        assert float(whole[6]) == 1 > float(docs[6]), (whole, docs)


def test_first_step_tiny():
    """A cold run and a warm one: every phase of the time to step 1 in both columns,
    and the warm run loads what the cold one compiled."""
    lines = run_tiny("first_step.py").stdout.splitlines()
    rows = table_rows(lines, "start + imports", "trace", "lower", "compile", "first step (total)")
    assert [len(r) for r in rows] == [3] * 5, lines
    warm = next(line for line in lines if line.startswith("warm: cache hits"))
    assert int(warm.split()[3].rstrip(",")) >= 1, lines
    assert any(line.startswith("| jit(train_step) |") for line in lines), lines


def test_vs_maxtext_tiny():
    """ndjax's side alone (MaxText is no dependency): the first step, the step times, and
    the compiled step's collectives on replica 2 x fsdp 2 x tensor 2, FSDP's weight
    gathers among them."""
    lines = run_tiny("vs_maxtext.py").stdout.splitlines()
    (row,) = table_rows(lines, "ndjax")
    assert float(row[1].split()[0]) > 0 and float(row[2].split()[0]) > 0, lines
    gathers = table_rows(lines, "all-gather")
    assert len(gathers) == 1 and int(gathers[0][1].split(",")[0]) > 0, lines


def test_sft_input_tiny():
    lines = run_tiny("sft_input.py").stdout.splitlines()
    assert lines[1].startswith("| tree | open s | fill |") and lines[3].startswith("| this tree |")


def test_data_order_tiny():
    lines = run_tiny("data_order.py").stdout.splitlines()
    assert [r[0] for r in table_rows(lines, "this tree")] == ["this tree"], lines


def test_data_wait_tiny():
    lines = run_tiny("data_wait.py").stdout.splitlines()
    assert [r[0] for r in table_rows(lines, "2", "0")] == ["2", "0"], lines


def test_gloo_cache_hang_tiny():
    """Two 2-process train.py runs, one per mode. ndjax's mode ("off": the persistent
    compilation cache off for multi-process CPU runs) must end, every time: a hang or
    a failure there fails this test. The other mode ("kept") may hang (what the script
    counts) but not fail, which is what a rotted flag or config looks like."""
    out = run_tiny("gloo_cache_hang.py")
    rows = {r[0]: r for r in table_rows(out.stdout.splitlines(), "kept", "off")}
    assert list(rows) == ["kept", "off"], out.stdout
    # columns: mode, ok, hung, failed, ...; stderr holds a failed process's last lines
    assert rows["off"][1:4] == ["1", "0", "0"], (out.stdout, out.stderr)
    kept = rows["kept"]
    assert kept[3] == "0" and int(kept[1]) + int(kept[2]) == 1, (out.stdout, out.stderr)


def test_gpu_tiny():
    lines = run_tiny("gpu.py").stdout.splitlines()
    numerics = table_rows(lines, "cudnn vs dense")[0]
    assert numerics[-1] == "skipped: cuDNN runs on a GPU only", lines
    grouped = table_rows(lines, "mosaic vs ragged_dot")[0]
    assert grouped[-1] == "skipped: the Mosaic GPU kernels run on a GPU only", lines
    rows = table_rows(lines, "remat none", "kernel tiled", "kernel cudnn")
    assert [r[:4] for r in rows] == [["remat none", "dense", "128", "8"],
                                     ["kernel tiled", "tiled", "256", "2"],
                                     ["kernel cudnn", "cudnn", "256", "-"]], lines
    assert float(rows[0][5].replace(",", "")) > 0, rows  # tokens/s measured
    assert rows[2][-1].startswith("refused: model.attn_impl='cudnn' runs on NVIDIA GPUs"), rows


def test_gpu_kernel_numerics_measures_a_kernel_against_dense():
    """bench/gpu.py's cuDNN check, run here with the tiled kernel (cuDNN needs a GPU):
    its errors are bfloat16's, well under the values' scale of 1, and not zero (the
    kernel ran in bfloat16, the reference in float32)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gpu", os.path.join(ROOT, "bench/gpu.py"))
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    errors = gpu.kernel_numerics("tiled", 512, heads=4, kv_heads=2, head_dim=32)
    assert list(errors) == ["causal", "window 256 scale 0.1"]
    for errs in errors.values():
        assert list(errs) == ["out", "dq", "dk", "dv"]
        assert all(0 < e < 0.1 for e in errs.values()), errors


def test_gpu_grouped_numerics_measure_the_kernels_against_float32():
    """bench/gpu.py's grouped-matmul check at a small size, the Mosaic GPU kernels
    interpreted on CPU: their errors are bfloat16's, as ragged_dot's own in bfloat16
    (within 2x), and not zero."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gpu", os.path.join(ROOT, "bench/gpu.py"))
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    errors = gpu.grouped_numerics(rows=256, dim=128, width=64, experts=4)
    assert list(errors) == ["mosaic", "ragged_dot bf16"]
    for name in ("out", "dx", "dw"):
        mosaic, xla = errors["mosaic"][name], errors["ragged_dot bf16"][name]
        assert 0 < mosaic < 0.02 and mosaic < 2 * xla, errors
    # Capacity mode's shape: rows past the groups hold NaN and come back zero.
    past = gpu.grouped_numerics(rows=256, dim=128, width=64, experts=4, in_groups=0.75)
    for errs in past.values():
        assert errs["nan"] == 0 and errs["past"] == 0 and max(
            errs[n] for n in ("out", "dx", "dw")) < 0.02, past


def test_gpu_cases_are_valid_configs():
    """The GPU run's configs pass every check here too (no compiling), so the first
    GPU run does not find a typo; only the fused kernels refuse a CPU."""
    import importlib.util

    import pytest

    from ndjax.runtime.errors import ConfigError

    spec = importlib.util.spec_from_file_location("bench_gpu", os.path.join(ROOT, "bench/gpu.py"))
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    for case in gpu.cases(tiny=False):
        if case.get("kind") == "numerics":  # no config: attention alone
            continue
        if case["model"].get("attn_impl") in ("cudnn", "pallas"):
            with pytest.raises(ConfigError, match="runs on NVIDIA GPUs"):
                gpu._experiment(case, case["ladder"][-1], jax.devices()[:1])
        elif case["model"].get("moe_impl") == "mosaic":
            with pytest.raises(ConfigError, match="run on NVIDIA Hopper GPUs"):
                gpu._experiment(case, case["ladder"][-1], jax.devices()[:1])
        else:
            exp = gpu._experiment(case, case["ladder"][-1], jax.devices()[:1])
            assert exp.model_cfg.dtype == jax.numpy.bfloat16, case


def test_hf_memory_tiny():
    """Export then import at a small shard size (several files) and at the default
    (one file); the figures themselves (MiB of RSS) are not checked."""
    lines = run_tiny("hf_memory.py").stdout.splitlines()
    rows = table_rows(lines, "export", "import")
    assert [r[:2] for r in rows] == [["export", "40KB"], ["import", "40KB"],
                                     ["export", "default"], ["import", "default"]], lines
    assert int(rows[0][2]) > 3 and rows[0][2] == rows[1][2], lines
    assert rows[2][2] == rows[3][2] == "1", lines
    # before, phase peak, added, process peak (mapped pages may shrink under pressure)
    assert all(float(cell) >= 0 for r in rows for cell in r[3:6] + r[7:]), lines

def test_generate_tiny():
    lines = run_tiny("generate.py").stdout.splitlines()
    layouts = ["1 device", "fsdp=4 x tensor=2", "replica=4 x tensor=2"]
    rows = table_rows(lines, *layouts)
    assert [r[0] for r in rows] == layouts, lines
    assert all(float(c) > 0 for r in rows for c in r[1:]), lines


def test_attention_memory_tiny():
    lines = run_tiny("attention_memory.py").stdout.splitlines()
    rows = table_rows(lines, "dense", "tiled", "auto")
    # auto: dense at 256 tokens, blocked at 512
    assert [r[:2] for r in rows] == [["dense", "dense"], ["tiled", "tiled"],
                                     ["auto", "blocked/dense"]], lines


def test_layout_accounting_tiny():
    """FSDP's weight gathers move exactly the textbook's bytes (bf16, forward and the
    backward's recompute); TP's memory above the ideal is the replicated kv weights."""
    lines = run_tiny("layout_accounting.py").stdout.splitlines()
    memory = [r for r in table_rows(lines, "FSDP", "TP") if r[1].isdigit()]
    assert [r[:3] for r in memory] == [["FSDP", "8", "fsdp (8)"], ["TP", "8", "tensor (8)"]], lines
    assert float(memory[0][6]) < 1.01 and "kv weights replicated" in memory[1][8], memory
    gathers = [r for r in table_rows(lines, "FSDP") if r[1] == "all-gather"]
    assert len(gathers) == 1 and gathers[0][6] == "1.000", lines


def test_cpu_vs_torch_tiny():
    """One round of one step each, ndjax and PyTorch, on one device (the multi-device
    layouts spawn up to 8 PyTorch processes: too slow for the suite)."""
    lines = run_tiny("cpu_vs_torch.py").stdout.splitlines()
    rows = table_rows(lines, "1 device")
    assert len(rows) == 1, lines
    layout, devices, ndjax, torch, ratio = rows[0][:5]
    assert devices == "1" and float(ndjax.replace(",", "")) > 0, rows
    assert float(torch.replace(",", "")) > 0 and ratio.endswith("x"), rows


def test_cpu_step_variants_tiny():
    """Each variant runs what it names; unset, a small model on CPU runs its layers
    unrolled with dense attention at 256 tokens (decoder.default_scan_layers,
    attention.choose)."""
    lines = run_tiny("cpu_step_variants.py").stdout.splitlines()
    rows = table_rows(lines, "scanned, dense", "defaults (scan_layers unset, attn_impl auto)")
    assert [r[1:3] for r in rows] == [["scanned", "dense"], ["unrolled", "dense"]], lines
    assert all(float(r[4]) > 0 for r in rows), rows


def test_cp_algorithms_tiny():
    """Ring and all-to-all on the same mesh, each sending what its algorithm sends:
    collective-permutes for the ring, all-to-alls (and no permutes) for the other."""
    lines = run_tiny("cp_algorithms.py").stdout.splitlines()
    header = next(line for line in lines if line.startswith("| cp_impl |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    rows = {r[0]: dict(zip(columns, r)) for r in table_rows(lines, "ring", "all_to_all")}
    assert list(rows) == ["ring", "all_to_all"], lines
    assert rows["ring"]["attention"] == "ring", rows
    assert rows["all_to_all"]["attention"] == "all_to_all+dense", rows  # 256 tokens
    assert float(rows["ring"]["collective-permute MiB"]) > 0, rows
    assert float(rows["all_to_all"]["all-to-all MiB"]) > 0, rows
    assert float(rows["all_to_all"]["collective-permute MiB"]) == 0, rows
    assert all(float(r["tokens/s"].replace(",", "")) > 0 for r in rows.values()), rows



def test_grpo_speed_tiny():
    """bench/grpo_speed.py: one GRPO step's rollout and train step timed apart, the
    parts within the whole (each rounded to 1 ms)."""
    lines = run_tiny("grpo_speed.py").stdout.splitlines()
    header = next(line for line in lines if line.startswith("| model |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    rows = [dict(zip(columns, r)) for r in table_rows(lines, "dim 64, 2 layers")]
    assert [r["layout"] for r in rows] == ["1 device"], lines
    (r,) = rows
    assert float(r["rollout tok/s"].replace(",", "")) > 0, r
    assert float(r["train tok/s"].replace(",", "")) > 0, r
    parts = float(r["sampling s"]) + float(r["rewards s"]) + float(r["step s"])
    assert 0 < parts <= float(r["total s"]) + 0.002, r
