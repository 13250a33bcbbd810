import jax
import pytest
from jax.sharding import PartitionSpec as P

from ndjax.parallel.mesh import ParallelDims, build_mesh
from ndjax.parallel.rules import PRESETS, Rules, constrain, get_table, use
from ndjax.runtime.errors import ConfigError


@pytest.fixture(scope="module")
def mesh():
    return build_mesh(ParallelDims(replica=2, fsdp=2, context=1, tensor=2))


def test_default_preset_specs(mesh):
    r = Rules("default", mesh)
    # context has size 1: dropped; trailing Nones are trimmed.
    assert r.spec(("act_batch", "act_seq", "act_embed")) == P(("replica", "fsdp"))
    assert r.spec(("layers", "embed", "q_heads", "head_dim")) == P(None, "fsdp", "tensor")
    assert r.spec(("layers", "mlp", "embed")) == P(None, "tensor", "fsdp")
    assert r.spec(("vocab", "embed")) == P("tensor", "fsdp")
    assert r.spec(("layers", "norm")) == P()


def test_compute_spec_gathers_over_data_axes(mesh):
    r = Rules("default", mesh)
    assert r.data_axes == {"replica", "fsdp"}
    assert r.compute_spec(("embed", "q_heads", "head_dim")) == P(None, "tensor")
    zero3 = Rules("zero3_everywhere", mesh)
    assert zero3.spec(("embed", "mlp")) == P(("replica", "fsdp"), "tensor")
    assert zero3.compute_spec(("embed", "mlp")) == P(None, "tensor")


def test_megatron_sp_splits_residual_sequence_over_tensor(mesh):
    r = Rules("megatron_sp", mesh)
    assert r.spec(("act_batch", "act_res_seq", "act_embed")) == P(("replica", "fsdp"), "tensor")
    assert r.spec(("act_batch", "act_seq", "act_embed")) == P(("replica", "fsdp"))


def test_one_mesh_axis_is_used_once_per_array(mesh):
    r = Rules((("a", "tensor"), ("b", ("tensor", "fsdp"))), mesh)
    assert r.spec(("a", "b")) == P("tensor", "fsdp")


def test_first_matching_rule_wins(mesh):
    r = Rules((("a", "fsdp"), ("a", "tensor")), mesh)
    assert r.spec(("a",)) == P("fsdp")


def test_missing_name_lists_the_table(mesh):
    with pytest.raises(ConfigError, match=r"'nope' has no rule(.|\n)*act_batch"):
        Rules("default", mesh).spec(("nope",))


@pytest.mark.parametrize("table, match", [
    ("nonexistent", r"not a preset"),
    ((("embed", "gpu"),), r"unknown mesh axes \['gpu'\]"),
    ((("embed",),), r"not a \(logical_name, mesh_axes\) pair"),
])
def test_bad_tables(table, match):
    with pytest.raises(ConfigError, match=match):
        get_table(table)


def test_presets_are_plain_data():
    for table in PRESETS.values():
        assert get_table(table) == table


def test_constrain_needs_active_rules(mesh):
    x = jax.numpy.zeros((8, 4, 2))
    names = ("act_batch", "act_seq", "act_embed")
    text_without = jax.jit(lambda x: constrain(x, names)).lower(x).as_text()
    assert "sharding_constraint" not in text_without
    with use(Rules("default", mesh)):
        text_with = jax.jit(lambda x: constrain(x, names)).lower(x).as_text()
    assert 'sharding_constraint %arg0 <@mesh, [{"replica", "fsdp"}, {}, {}]>' in text_with
