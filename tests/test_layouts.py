"""Every layout trains exactly like one device (f32).

Tolerances (helpers.assert_same_training): the losses of 3 AdamW steps at rtol
1e-5, and the first step's gradients within 1e-5 of each parameter's largest
gradient. Layouts differ from one device only in the order of floating-point
reductions (all-reduce trees, split matmuls), which moves f32 results by ~1e-7
relative. Parameters after Adam are not compared: Adam divides by sqrt(v), so a
near-zero gradient entry turns that noise into a parameter difference.
"""

import jax
import pytest
from conftest import tiny_config
from helpers import assert_same_training

from ndjax.experiment import Experiment

LAYOUTS = {
    "dp": (dict(replica=8), {}),
    "fsdp": (dict(fsdp=8), {}),
    # tensor=8 must split whole kv heads, so this model has 8 of them.
    "tp": (dict(tensor=8), dict(n_kv_heads=8)),
    "hsdp": (dict(replica=2, fsdp=4), {}),
    "fsdp_tp": (dict(fsdp=4, tensor=2), {}),
    "replica_fsdp_tp": (dict(replica=2, fsdp=2, tensor=2), {}),
    # More tensor shards than kv heads: each kv head is replicated on the shards
    # whose query heads use it (MQA: one kv head; GQA: 2 kv heads on tensor=4).
    "tp_mqa": (dict(tensor=4, fsdp=2), dict(n_kv_heads=1)),
    "tp_gqa_wider_than_kv": (dict(tensor=4, fsdp=2), dict(n_kv_heads=2)),
    "tp8_mqa": (dict(tensor=8), dict(n_kv_heads=1)),
}

@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_matches_single_device(layout):
    mesh, model = LAYOUTS[layout]
    exp = Experiment.from_config(tiny_config(mesh=mesh, model=model))
    assert_same_training(exp, model)


@pytest.mark.parametrize("rules", ["megatron_sp", "zero3_everywhere"])
def test_rule_presets_match_single_device(rules):
    exp = Experiment.from_config(tiny_config(mesh=dict(replica=2, fsdp=2, tensor=2), rules=rules))
    assert_same_training(exp, {})


def test_custom_rule_table_matches_single_device():
    # A full table in the config: batch over replica x fsdp, parameters only
    # over fsdp (nothing else sharded).
    table = (("act_batch", ("replica", "fsdp")), ("act_seq", None), ("act_res_seq", None),
             ("act_embed", None), ("act_heads", None), ("act_kv_heads", None),
             ("act_head_dim", None), ("act_mlp", None), ("act_vocab", None),
             ("layers", None), ("vocab", None), ("embed", "fsdp"), ("q_heads", None),
             ("kv_heads", None), ("head_dim", None), ("mlp", None), ("norm", None))
    exp = Experiment.from_config(tiny_config(mesh=dict(replica=2, fsdp=4), rules=table))
    assert exp.state_sharding.params["layers"]["mlp"]["w_up"].spec == jax.P(None, "fsdp")
    assert_same_training(exp, {})
