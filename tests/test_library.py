"""ndjax as a library: Accelerate's ParallelismConfig names for the mesh."""

import os
import subprocess
import sys
import types

import pytest
from conftest import tiny_config
from jax.sharding import AxisType

import ndjax
from ndjax.config import Settings
from ndjax.errors import ConfigError
from ndjax.mesh import AXES, ParallelDims, build_mesh
from ndjax.ops import attention
from ndjax.parallelism import CP_STRATEGIES, ContextParallelConfig, ParallelismConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    assert ndjax.ParallelismConfig is ParallelismConfig is ndjax.mesh.ParallelismConfig
    assert dict(ParallelismConfig(dp_shard_size=-1).build_mesh(cpu_devices[:2]).shape)["fsdp"] == 2


def test_apply_to_an_ndjax_config():
    config = ParallelismConfig(dp_shard_size=-1, tp_size=2, cp_size=2,
                               cp_handler=ContextParallelConfig("alltoall")).apply_to(tiny_config())
    assert dict(config.mesh) == dict(replica=1, fsdp=-1, context=2, tensor=2)
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
                       r"dp_shard_size=4, cp_size=1, tp_size=1 multiply to 4, but there are 8"):
        ParallelismConfig(dp_shard_size=4).build_mesh(cpu_devices)
    with pytest.raises(ConfigError, match=r"dp_shard_size=-1 takes the remaining devices"):
        _ = ParallelismConfig(dp_shard_size=-1).total_size


def test_import_ndjax_imports_no_jax():
    code = ("import sys, ndjax; assert 'jax' not in sys.modules, 'jax imported'; "
            "from ndjax import ParallelismConfig; assert 'jax' in sys.modules")
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
