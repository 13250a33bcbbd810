"""8 simulated CPU devices for every test, and a tiny model config."""

import os
import tempfile

import jax
import pytest

from ndjax.hardware import gpu_target

# The 8 simulated devices meet in a rendezvous at every collective, and XLA aborts the
# process (no Python error) when one device's thread has not arrived within 40 s
# (--xla_cpu_collective_call_terminate_timeout_seconds). On CI's 2 cores, beside the
# other test worker and the train.py processes tests start, a starved step crossed
# that line once ("Fatal Python error: Aborted" inside a step). Tests wait longer;
# train.py subprocesses inherit it.
_FLAGS = [os.environ.get("XLA_FLAGS", ""),
          "--xla_cpu_collective_call_terminate_timeout_seconds=600"]
# The tests' models are tiny, so compiling is most of a test's time, and most of that
# is LLVM optimising CPU code: the suite turns LLVM's optimisations off, as the
# planner does (ndjax.planning.planner.MEASURE_OPTIONS). The HLO and its buffers are the same
# (test_plan.py compares them with the default levels), in half the time on CI's 2
# cores. Not where XLA's GPU compiler is installed: the GPU compiles
# (tests/test_gpu_compile.py, CI's second run of leg 1) are what train.py gets.
if gpu_target.missing():
    _FLAGS += ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
# jax 0.10's XLA still has the CPU backend's older elemental emitters, which compile a
# step in two thirds of the time of its MLIR fusion emitters (the same fusions and
# buffers: only each fusion's code is written another way). A CPU option, so the GPU
# compiles keep train.py's. jax 0.12's XLA has only the fusion emitters and aborts on it.
if jax.__version_info__ < (0, 11):
    _FLAGS += ["--xla_cpu_use_fusion_emitters=false"]
os.environ["XLA_FLAGS"] = " ".join(_FLAGS).strip()

# CPU devices even where jax's CUDA plugin is installed (the gpu-compile extra): its
# GPUs are compile-only targets (tests/test_gpu_compile.py), never the backend.
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

# Many tests compile the same programs (the same tiny model on the same mesh)
# through different jit objects; a persistent compilation cache, fresh for each
# test session, turns those repeats into cache hits. train.py subprocesses
# started by the tests share it through the environment.
_CACHE = os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                               tempfile.mkdtemp(prefix="ndjax-test-xla-cache-"))
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

from ndjax.config import default_config  # noqa: E402

# d <= 64, 2 layers: big enough to have every kind of parameter and to split 8
# ways, small enough to compile in seconds.
TINY_MODEL = dict(vocab_size=256, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=128,
                  rope_theta=10_000.0)


def tiny_config(mesh=None, rules="default", model=None, train=None, export=None):
    c = default_config()
    # Scanned layers, as on a GPU, rather than the unrolled ones a small model gets
    # on CPU by default: the layouts' tests are about the path GPU users run.
    c.model.update({**TINY_MODEL, "scan_layers": True, **(model or {})})
    c.mesh.update({**dict(replica=1, fsdp=1, context=1, tensor=1), **(mesh or {})})
    c.rules = rules
    # The Markov-chain source: fast, learnable, and any vocab_size fits it.
    c.data.source = "synthetic"
    # Constant LR from step 1 so that 3 steps move the parameters for real.
    # Adam's eps bounds how much it amplifies rounding noise in a gradient:
    # |d update| <= lr * |d grad| / eps. With the usual 1e-8, a gradient entry
    # that happens to be ~1e-8 turns reduction-order noise (~1e-10) into a
    # 1e-3 parameter difference between layouts; 1e-6 keeps it below 1e-6.
    c.train.update({**dict(steps=3, batch_size=8, seq_len=32, lr=1e-2, warmup_steps=0,
                           schedule="constant", eps=1e-6), **(train or {})})
    c.export.update(export or {})
    return c


@pytest.fixture(scope="session")
def cpu_devices():
    devices = jax.devices()
    assert len(devices) == 8 and devices[0].platform == "cpu", devices
    return devices


def pytest_addoption(parser):
    parser.addoption(
        "--params-per-test", type=int, default=None, metavar="N",
        help="run N parameter sets of each parametrized test, spread from its first to its "
             "last: CI's newest-jax leg, which checks that each test's code runs on that "
             "jax while the first leg runs every parameter set")


# The longest tests (minutes on 2 cores), started first: pytest-xdist hands tests out in
# collection order, and one of these started last keeps a worker busy while the other idles.
LONGEST = ("test_bench_gpu_cases_compile_for_an_h200", "test_bench_open_models_tiny",
           "test_bench_moe_layouts_tiny", "test_gloo_cache_hang_tiny",
           "test_cpu_step_variants_tiny", "test_context_parallel_tiny",
           "test_plan_for_the_top_layouts_compiles_less_and_ranks_the_same",
           "test_plan_rejects_with_reasons_and_fits_with_remat",
           "test_importing_ndjax_keeps_step_temporaries_mapped")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: getattr(item, "originalname", item.name) not in LONGEST)
    cap = config.getoption("--params-per-test")
    if cap is None:
        return
    groups: dict[tuple[str, str], list] = {}
    for item in items:
        key = (item.nodeid.split("::")[0], getattr(item, "originalname", item.name))
        groups.setdefault(key, []).append(item)
    keep = set()
    for group in groups.values():
        n = len(group)
        picks = range(n) if n <= cap else {round(i * (n - 1) / max(cap - 1, 1)) for i in range(cap)}
        keep.update(id(group[i]) for i in picks)
    dropped = [item for item in items if id(item) not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if id(item) in keep]
