"""ndjax as a library: Accelerate's ParallelismConfig names, and a model of the user's own
(examples/shard_your_model.py's MLP) sharded and trained by ndjax.step.shard."""

import importlib.util
import math
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import tiny_config
from flax import nnx
from jax.sharding import AxisType, PartitionSpec

import ndjax
from ndjax.config import Settings
from ndjax.ops import attention
from ndjax.parallel import rules as rules_lib
from ndjax.parallel.mesh import AXES, ParallelDims, build_mesh
from ndjax.parallel.parallelism import CP_STRATEGIES, ContextParallelConfig, ParallelismConfig
from ndjax.runtime.errors import ConfigError
from ndjax.step.shard import loss_and_grads, shard_model, split_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "shard_your_model.py")


def _example():
    spec = importlib.util.spec_from_file_location("shard_your_model", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ex = _example()


# ----- ParallelismConfig --------------------------------------------------------------

def test_accelerate_names_map_to_mesh_axes(cpu_devices):
    pc = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2, cp_size=1)
    assert pc.to_dims() == ParallelDims(replica=2, fsdp=2, context=1, tensor=2)
    assert pc.total_size == 8
    mesh = pc.build_mesh(cpu_devices)
    ref = build_mesh(ParallelDims(replica=2, fsdp=2, context=1, tensor=2), cpu_devices)
    assert mesh.axis_names == AXES and dict(mesh.shape) == dict(ref.shape)
    assert (mesh.devices == ref.devices).all()
    assert all(t == AxisType.Auto for t in mesh.axis_types)  # not jax.make_mesh's Explicit
    # None is Accelerate's "unset" (1 without its launcher); -1 takes the rest.
    assert ParallelismConfig(dp_shard_size=None).dp_shard_size == 1
    filled = ParallelismConfig(dp_shard_size=-1, cp_size=2).resolve(8)
    assert (filled.dp_shard_size, filled.total_size) == (4, 8)
    assert ndjax.ParallelismConfig is ParallelismConfig
    assert dict(ParallelismConfig(dp_shard_size=-1).build_mesh(cpu_devices[:2]).shape)["fsdp"] == 2


def test_apply_to_an_ndjax_config():
    config = ParallelismConfig(dp_shard_size=-1, tp_size=2, cp_size=2,
                               cp_handler=ContextParallelConfig("alltoall")).apply_to(tiny_config())
    assert dict(config.mesh) == dict(replica=1, fsdp=-1, expert=1, context=2, tensor=2, stage=1,
                                     virtual_stages=1, pipeline_schedule="gpipe", auto=False)
    assert config.model.cp_impl == "all_to_all"
    Settings.parse(config)  # a config ndjax accepts
    # Accelerate's own handler object is read the same way (only cp_comm_strategy).
    ring = types.SimpleNamespace(cp_comm_strategy="ring")
    assert ParallelismConfig(cp_handler=ring).apply_to(tiny_config()).model.cp_impl == "ring"
    assert ParallelismConfig().apply_to(tiny_config()).model.cp_impl == "auto"  # left as it was
    assert set(CP_STRATEGIES.values()) <= set(attention.CP_IMPLS)


@pytest.mark.parametrize("kwargs, match", [
    (dict(dp_shard_size=0), r"^dp_shard_size=0 must be >= 1, or -1"),
    (dict(tp_size=2.0), r"^tp_size=2.0 must be an int"),
    (dict(dp_shard_size=-1, cp_size=-1), r"dp_shard_size, cp_size are all -1"),
    (dict(cp_handler=ContextParallelConfig("allgather")),
     r"cp_comm_strategy='allgather' has no ndjax kernel; use 'ring'"),
    (dict(cp_handler="ring"), r"cp_handler='ring' has no cp_comm_strategy"),
    (dict(tp_handler=types.SimpleNamespace(enable_async_tp=True)),
     r"enable_async_tp=True has no ndjax meaning"),
])
def test_bad_values_are_one_line_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match) as e:
        ParallelismConfig(**kwargs)
    assert "\n" not in str(e.value)


def test_sizes_that_do_not_fit_the_devices(cpu_devices):
    with pytest.raises(ConfigError, match=r"ParallelismConfig: dp_replicate_size=1, "
                       r"dp_shard_size=4, ep_size=1, cp_size=1, tp_size=1 multiply to 4, "
                       r"but there are 8"):
        ParallelismConfig(dp_shard_size=4).build_mesh(cpu_devices)
    with pytest.raises(ConfigError, match=r"dp_shard_size=-1 takes the remaining devices"):
        _ = ParallelismConfig(dp_shard_size=-1).total_size


def test_import_ndjax_imports_no_jax():
    code = ("import sys, ndjax; assert 'jax' not in sys.modules, 'jax imported'; "
            "from ndjax import ParallelismConfig, make_train_step; assert 'jax' in sys.modules")
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr


# ----- shard_model and make_train_step ------------------------------------------------

def _mesh(devices, **sizes):
    return ParallelismConfig(**sizes).build_mesh(devices)


def test_parameters_and_moments_are_stored_as_the_rules_say(cpu_devices):
    mesh = _mesh(cpu_devices, dp_shard_size=4, tp_size=2)
    model = ex.shard_model(lambda: ex.MLP(nnx.Rngs(0)), mesh, ex.RULES)
    P = PartitionSpec  # noqa: N806
    expected = {  # embed -> fsdp, mlp -> tensor, classes -> whole
        ("up", "kernel"): P("fsdp", "tensor"), ("up", "bias"): P("tensor"),
        ("down", "kernel"): P("tensor", "fsdp"), ("down", "bias"): P("fsdp"),
        ("head", "kernel"): P("fsdp"), ("head", "bias"): P(),
    }
    for (layer, name), spec in expected.items():
        value = getattr(getattr(model, layer), name)[...]
        assert value.sharding.spec == spec, (layer, name, value.sharding.spec)
        ways = [math.prod(mesh.shape[a] for a in rules_lib.axes_of(s)) for s in spec]
        shard = tuple(d // w for d, w in zip(value.shape, ways + [1] * value.ndim))
        assert value.addressable_shards[0].data.shape == shard
    step = ex.make_train_step(ex.loss_fn, optax.adamw(1e-2), model, mesh, ex.RULES)
    state = step.init(model)
    adam = state.opt_state[0]
    for tree in (adam.mu, adam.nu):
        for moment, param in zip(jax.tree.leaves(tree), jax.tree.leaves(state.params)):
            assert moment.sharding == param.sharding
    # The model's own activation constraint (hidden: act_batch x act_mlp) is in the
    # step: it was traced under the mesh and the rules.
    hlo = step.lower(state, ex.make_batch(jax.random.key(0))).as_text()
    assert 'sharding_constraint %' in hlo
    assert '[{"fsdp"}, {"tensor"}]> : tensor<64x128xf32>' in hlo


def _train(mesh, batches, lr=1e-2):
    model = ex.shard_model(lambda: ex.MLP(nnx.Rngs(0)), mesh, ex.RULES)
    graphdef, params = split_params(model)
    rules = rules_lib.Rules(ex.RULES, mesh)
    with rules_lib.use(rules):  # the step's own loss and gradient, first batch
        grads = jax.jit(lambda p, b: loss_and_grads(ex.loss_fn, graphdef, p, b)[1])(
            params, batches[0])
    # eps 1e-6: Adam's division by sqrt(nu) + eps amplifies rounding differences of a tiny
    # gradient entry by up to lr / eps (see tests/conftest.py's tiny_config).
    step = ex.make_train_step(ex.loss_fn, optax.adamw(lr, eps=1e-6), model, mesh, rules)
    state = step.init(model)
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(grads), jax.device_get(state.params)


def test_fsdp_x_tp_equals_one_device(cpu_devices):
    batches = [jax.device_get(ex.make_batch(jax.random.key(i))) for i in range(3)]
    sharded = _train(_mesh(cpu_devices, dp_shard_size=4, tp_size=2), batches)
    single = _train(_mesh(cpu_devices[:1]), batches)
    np.testing.assert_allclose(sharded[0], single[0], rtol=1e-5)
    assert sharded[0][-1] < sharded[0][0]
    # First-step gradients differ by reduction order only (~5e-8 of entries up to 0.4).
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7),
                 sharded[1], single[1])
    # After 3 Adam steps (each moves an entry by up to lr = 1e-2) a tiny gradient entry's
    # rounding shows more: ~2e-6 measured.
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, atol=2e-5),
                 sharded[2], single[2])


def test_library_errors_name_the_parameter_or_batch(cpu_devices):
    mesh = _mesh(cpu_devices, dp_shard_size=4, tp_size=2)

    class Bare(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros((8, 8)))

    with pytest.raises(ConfigError, match=r"parameter w \(shape \(8, 8\)\) has logical_axes=None"):
        shard_model(Bare, mesh)
    with pytest.raises(ConfigError, match=r"parameter head/(bias|kernel): logical axis "
                                          r"'classes' has no rule"):
        shard_model(lambda: ex.MLP(nnx.Rngs(0)), mesh)  # the default table lacks 'classes'

    class Odd(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros((6, 8)), logical_axes=("embed", "mlp"))

    with pytest.raises(ConfigError, match=r"size 6 \(parameter w, dimension 0, logical axis "
                                          r"'embed'\) cannot be split 4 ways"):
        shard_model(Odd, mesh)

    class Norm(nnx.Module):
        def __init__(self):
            self.bn = nnx.BatchNorm(8, rngs=nnx.Rngs(0))

    with pytest.raises(ConfigError, match=r"model: bn/mean is an nnx.BatchStat"):
        shard_model(Norm, mesh)

    model = shard_model(lambda: ex.MLP(nnx.Rngs(0)), mesh, ex.RULES)
    step = ex.make_train_step(ex.loss_fn, optax.adamw(1e-2), model, mesh, ex.RULES)
    with pytest.raises(ConfigError, match=r"batch x: dimension 0 \('act_batch'\) has size 6, "
                                          r"which 4 = fsdp\(4\) cannot split evenly") as e:
        step(step.init(model), ex.make_batch(jax.random.key(0), rows=6))
    assert "\n" not in str(e.value)


def test_example_runs_as_a_script():
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, EXAMPLE], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(line.rsplit(" ", 1)[1]) for line in out.stdout.splitlines()
              if line.startswith("step ")]
    assert len(losses) == 8 and all(np.isfinite(losses)), out.stdout
    assert losses[-1] < losses[0], out.stdout
