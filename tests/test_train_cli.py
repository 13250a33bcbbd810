"""train.py as a user runs it: real subprocesses."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from data_files import data_config
from helpers import train_py_flags

from ndjax.data.loader import make_loader

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_FLAGS = train_py_flags()


def run(*args, cwd=ROOT, env=None):
    env = {**(os.environ if env is None else env), "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)


def losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert isinstance(r["loss"], float) and np.isfinite(r["loss"])
    return np.array([r["loss"] for r in records])


def test_layouts_log_the_same_losses(tmp_path):
    a, b = tmp_path / "fsdp_tp", tmp_path / "dp"
    first = run("--config=configs/llama_fsdp_tp.py", f"--workdir={a}", *TINY_FLAGS)
    assert first.returncode == 0, first.stderr[-2000:]
    second = run("--config=configs/llama_dp.py", f"--workdir={b}", *TINY_FLAGS)
    assert second.returncode == 0, second.stderr[-2000:]
    np.testing.assert_allclose(losses(a), losses(b), rtol=1e-5)
    assert "step 3/3" in first.stdout
    assert json.load(open(a / "config.json"))["mesh"]["tensor"] == 2
    # A start-up summary before compiling, the step's memory after, an end summary.
    out = first.stdout
    for field in ("devices: 8 x cpu", "mesh replica=1 x fsdp=4 x context=1 x tensor=2",
                  "rules default", "parameters (", "without embeddings", "compute float32",
                  "attention: dense", "batch: 8 rows x 32 tokens = 256 tokens per step",
                  "data synthetic", f"workdir: {a}; starting at step 1",
                  "compiled the train step in", "memory per device:", "done: step 3, train loss",
                  "tokens/s", f"checkpoint: {a / 'checkpoints' / '3'}",
                  f"ndjax plot --workdir={a}"):
        assert field in out, (field, out)
    assert out.index("workdir:") < out.index("compiled the") < out.index("step 1/3") \
        < out.index("done: step 3")
    # Quiet by default: no library INFO lines (orbax, absl, jax) on stderr.
    for result in (first, second):
        assert not [line for line in result.stderr.splitlines() if line.startswith("I")], \
            result.stderr[-2000:]


def test_verbosity_brings_library_info_back(tmp_path):
    result = run("--verbosity=0", f"--workdir={tmp_path}", *TINY_FLAGS)
    assert result.returncode == 0, result.stderr[-2000:]
    assert any(line.startswith("I") for line in result.stderr.splitlines())


@pytest.mark.parametrize("args, message", [
    (["--config.mesh.tensor=3"], "multiply to 12, but there are 8 devices"),
    (["--config.model.n_heads=12", "--config.model.n_kv_heads=3", "--config.model.dim=96"],
     "model.n_kv_heads=3 cannot be laid over 2 = tensor(2)"),
    (["--config.train.stpes=3"], 'Did you mean "steps"'),
    (["--config.train.batch_size=6"], "train.batch_size=6 is not divisible by 4 = fsdp(4)"),
    (["--config=configs/missing.py"], "cannot load --config"),
    (["--config.model.init_from=meta-llama/Llama-3.2-1B"], "ndjax does not download"),
    (["--config.runtime.coordinator=node0", "--config.runtime.num_processes=2",
      "--config.runtime.process_id=0"], "runtime.coordinator='node0' must be host:port"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    assert_one_line_error(run(*args, f"--workdir={tmp_path / 'w'}"), message)
    assert not (tmp_path / "w").exists()  # nothing half-written


def assert_one_line_error(result, message):
    """Exit 2 and stderr is exactly one line: the error, nothing before or after it."""
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.splitlines() == [result.stderr.strip()], result.stderr[-2000:]
    assert result.stderr.startswith("train.py: error:") and message in result.stderr, \
        result.stderr[-2000:]


@pytest.mark.parametrize("source, message", [
    ("def get_config(:\n    pass\n", "config.py: line 1: SyntaxError"),
    ("def get_config():\n    raise RuntimeError('no GPUs today')\n",
     "config.py: line 2: RuntimeError: no GPUs today"),
    ("import a_module_that_is_not_there\n", "config.py: line 1: ModuleNotFoundError"),
    ("X = 1\n", "config.py has no get_config() function"),
])
def test_config_file_that_fails_to_load_is_one_line(tmp_path, source, message):
    (tmp_path / "config.py").write_text(source)
    # Nothing runs before the config loads, so no thread can race the exit; a
    # syntax error is still tried 5 times, like the checkpoint error below.
    for _ in range(5 if "SyntaxError" in message else 1):
        result = run(f"--config={tmp_path / 'config.py'}", f"--workdir={tmp_path / 'w'}")
        assert_one_line_error(result, message)


def test_builtin_source_trains_and_logs_eval_and_data_wait(tmp_path):
    flags = [f for f in TINY_FLAGS if "vocab_size" not in f and "data.source" not in f]
    # One device: the layouts are tested above; this is about the data path.
    result = run(f"--workdir={tmp_path}", *flags, "--config.runtime.cpu_devices=1",
                 "--config.mesh.fsdp=1", "--config.mesh.tensor=1",
                 "--config.model.vocab_size=384", "--config.train.eval_every=2",
                 "--config.train.eval_steps=2")  # data.source: the default, builtin
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in records] == [1, 2, 2, 3] and [r["step"] for r in evals] == [2]
    assert all(0 <= r["data_wait"] < r["step_time"] + 1 for r in steps)
    ev = evals[0]
    assert 0 < ev["eval_loss"] < math.log(384) + 1
    assert ev["eval_perplexity"] == pytest.approx(math.exp(ev["eval_loss"]))
    # The first two batches of the stdlib's validation files, their unmasked targets.
    with make_loader(data_config("builtin", seq_len=32), 384, "eval", prefetch=0) as held_out:
        assert ev["eval_tokens"] == sum(held_out.batch(i)["loss_mask"].sum() for i in range(2))
    assert "eval loss" in result.stdout


def test_bad_data_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a line of text"}\n' * 50 + '{"body": "b"}\n')
    result = run("--config.data.source=jsonl", f"--config.data.files={bad}",
                 f"--workdir={tmp_path / 'w'}")
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("train.py: error:")]
    assert len(errors) == 1 and "bad.jsonl:51: no 'text' field" in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "w").exists()


def test_print_sharding(tmp_path):
    result = run("--print_sharding", "--config.model.preset=llama3_8b", f"--workdir={tmp_path}")
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "mesh: replica=1 x fsdp=4 x context=1 x tensor=2" in out
    # 8B on fsdp=4 x tensor=2: q projection split 4 ways on embed, 2 ways on heads.
    assert "layers/attn/wq" in out and "(32, 4096, 32, 128)" in out
    assert "(None, 'fsdp', 'tensor')" in out
    assert "parameters: 29.9 GiB in all, 3.7 GiB per device" in out


def test_nan_stop_exits_non_zero_with_one_line(tmp_path):
    result = run("--config=configs/llama_fsdp.py", f"--workdir={tmp_path}", *TINY_FLAGS,
                 "--config.debug.nan_at_step=2")
    assert result.returncode == 3, result.stderr[-2000:]
    stops = [line for line in result.stderr.splitlines() if line.startswith("train.py: stopped")]
    assert len(stops) == 1 and "at step 2 (last good step 1)" in stops[0]
    assert "Traceback" not in result.stderr


def test_default_experiment_config_fits_the_sampling_example():
    """configs/llama_fsdp_tp.py (train.py's default) parses, and its rows hold docs/sampling.md's
    `ndjax generate --prompt='def main(' --max_new_tokens=64` (max_len is the run's
    train.seq_len). Its model stays the preset's, so that the
    `--config.model.preset=llama3_8b` and model.init_from runs of this config in the README
    and docs/ get their own dims, not a demo's."""
    import importlib.util

    from ndjax.config import ModelSettings, Settings

    spec = importlib.util.spec_from_file_location(
        "llama_fsdp_tp", os.path.join(ROOT, "configs", "llama_fsdp_tp.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    settings = Settings.parse(module.get_config())
    assert settings.train.seq_len >= len(b"def main(") + 64
    assert settings.train.batch_size % (settings.mesh.fsdp * settings.mesh.replica) == 0
    dims = ("preset", "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
            "head_dim", "rope_theta", "rope_scaling", "tie_embeddings")
    assert {f: getattr(settings.model, f) for f in dims} == \
        {f: getattr(ModelSettings(), f) for f in dims}


def test_a_second_run_loads_its_compiled_step_from_the_persistent_cache(tmp_path):
    """runtime.compilation_cache=auto (the default): with no JAX_COMPILATION_CACHE_DIR,
    the cache is under the user's cache dir; the first run writes the train step
    there, the second loads it and writes nothing; with the setting off nothing is
    written, not even where JAX_COMPILATION_CACHE_DIR points."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "user-cache")
    cache = tmp_path / "user-cache" / "ndjax" / "xla"
    one_device = ["--config=configs/llama_dp.py", "--config.mesh.replica=1",
                  "--config.runtime.cpu_devices=1", *TINY_FLAGS, "--config.train.steps=1"]
    first = run(*one_device, f"--workdir={tmp_path / 'a'}", env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    written = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    assert any("train_step" in name for name in written), written
    # jax logs each persistent-cache hit when it logs compiles.
    second = run(*one_device, f"--workdir={tmp_path / 'b'}", env={**env, "JAX_LOG_COMPILES": "1"})
    assert second.returncode == 0, second.stderr[-2000:]
    assert "Persistent compilation cache hit for 'jit_train_step'" in second.stderr
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == written
    off_env = {**env, "XDG_CACHE_HOME": str(tmp_path / "off-user-cache"),
               "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "env-cache")}
    off = run(*one_device, f"--workdir={tmp_path / 'c'}", "--config.runtime.compilation_cache=off",
              env=off_env)
    assert off.returncode == 0, off.stderr[-2000:]
    assert not (tmp_path / "off-user-cache" / "ndjax").exists()
    assert not (tmp_path / "env-cache").exists()


def test_unwritable_workdir_is_one_line_before_compiling(tmp_path):
    """A regular file where a folder should be, and a place no one may create a folder
    (even root: /sys), are one line naming the path and the OS's reason, exit 2."""
    (tmp_path / "file").write_text("")
    for workdir in (str(tmp_path / "file" / "run"), "/sys/ndjax-test-workdir"):
        try:
            os.makedirs(workdir)
        except OSError as e:
            reason = e.strerror  # NotADirectoryError; /sys: EPERM as root, else EACCES/EROFS
        else:
            raise AssertionError(f"{workdir} could be created")
        result = run(f"--workdir={workdir}", *TINY_FLAGS)
        assert_one_line_error(result, f"--workdir={workdir!r}: cannot write {workdir}: {reason}")
        assert "compiled" not in result.stdout
