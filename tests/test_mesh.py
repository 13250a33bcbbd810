import jax
import pytest
from jax.sharding import AxisType

from ndjax.parallel.mesh import (
    AXES,
    ParallelDims,
    _split_across_processes,
    build_mesh,
    cross_process_axes,
)
from ndjax.parallel.parallelism import ParallelismConfig
from ndjax.runtime.errors import ConfigError


def test_axis_order_and_auto_types(cpu_devices):
    mesh = build_mesh(ParallelDims(replica=2, fsdp=2, context=1, tensor=2))
    assert mesh.axis_names == AXES == ("stage", "replica", "fsdp", "expert", "context", "tensor")
    assert dict(mesh.shape) == dict(stage=1, replica=2, fsdp=2, expert=1, context=1, tensor=2)
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    # tensor is innermost: a tensor group is two neighbouring devices.
    ids = [[d.id for d in row] for row in mesh.devices.reshape(-1, 2)]
    assert all(b == a + 1 for a, b in ids)


def test_fill_with_minus_one():
    assert ParallelDims(replica=2, fsdp=-1, tensor=2).resolve(8).fsdp == 2
    assert ParallelDims(replica=-1, fsdp=1).resolve(8).replica == 8


def test_accelerate_names_map_to_the_same_mesh(cpu_devices):
    pc = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2, cp_size=1)
    assert pc.to_dims() == ParallelDims(replica=2, fsdp=2, context=1, tensor=2)
    mesh = pc.build_mesh()
    ref = build_mesh(ParallelDims(replica=2, fsdp=2, context=1, tensor=2))
    assert mesh.shape == ref.shape and (mesh.devices == ref.devices).all()


@pytest.mark.parametrize("dims, match", [
    (ParallelDims(replica=2, fsdp=2, context=1, tensor=1), r"multiply to 4, but there are 8"),
    (ParallelDims(replica=-1, fsdp=-1), r"mesh.replica, mesh.fsdp are all -1"),
    (ParallelDims(replica=0, fsdp=-1), r"mesh.replica=0 must be >= 1"),
    (ParallelDims(replica=2.0, fsdp=-1), r"mesh.replica=2.0 must be an int"),
    (ParallelDims(replica=3, fsdp=-1), r"multiply to 3, which does not divide the 8"),
])
def test_bad_degrees(dims, match):
    with pytest.raises(ConfigError, match=match):
        dims.resolve(8)


def test_cross_node_split_keeps_tensor_inside_a_node():
    # 2 nodes: the across-node factor goes to replica first, then fsdp.
    assert _split_across_processes((2, 4, 1, 2), 2) == (2, 1, 1, 1)
    assert _split_across_processes((1, 8, 1, 2), 2) == (1, 2, 1, 1)
    assert _split_across_processes((1, 1, 2, 8), 2) == (1, 1, 2, 1)
    with pytest.raises(ConfigError, match="processes"):
        _split_across_processes((1, 1, 1, 3), 2)


def test_single_process_mesh_crosses_no_process(cpu_devices):
    mesh = build_mesh(ParallelDims(fsdp=-1), jax.devices())
    assert cross_process_axes(mesh) == []
