"""Bad input fails in Experiment.from_config, before anything compiles."""

import jax
import pytest
from conftest import tiny_config

from ndjax.experiment import Experiment
from ndjax.runtime.errors import ConfigError

KV_ONLY_REPLICATED = (
    ("act_batch", ("replica", "fsdp")), ("act_seq", "context"), ("act_res_seq", "context"),
    ("act_embed", None), ("act_heads", "tensor"), ("act_kv_heads", None),
    ("act_head_dim", None), ("act_mlp", "tensor"), ("act_vocab", "tensor"), ("layers", None),
    ("vocab", "tensor"), ("embed", "fsdp"), ("q_heads", "tensor"), ("kv_heads", None),
    ("head_dim", None), ("mlp", "tensor"), ("norm", None))

CASES = {
    "product != devices": (dict(mesh=dict(fsdp=2, tensor=2)),
                           r"multiply to 4, but there are 8 devices"),
    "two -1": (dict(mesh=dict(replica=-1, fsdp=-1)), r"at most one axis may be -1"),
    "size < 1": (dict(mesh=dict(fsdp=8, context=0)), r"mesh.context=0 must be >= 1"),
    "tensor vs heads": (dict(mesh=dict(tensor=8), rules=KV_ONLY_REPLICATED,
                             model=dict(n_heads=4, n_kv_heads=4, dim=64)),
                        r"model.n_heads=4 .* cannot be split 8 ways"),
    "tensor vs ffn": (dict(mesh=dict(fsdp=4, tensor=2), model=dict(ffn_dim=100 + 1)),
                      r"model.ffn_dim=101 .* cannot be split 2 ways"),
    "tensor vs vocab": (dict(mesh=dict(fsdp=4, tensor=2), model=dict(vocab_size=257)),
                        r"model.vocab_size=257 .* cannot be split 2 ways"),
    "fsdp vs dim": (dict(mesh=dict(fsdp=8), model=dict(dim=36, head_dim=8)),
                    r"model.dim=36 .* cannot be split 8 ways over mesh axes fsdp\(8\)"),
    "batch vs replica*fsdp": (dict(mesh=dict(replica=2, fsdp=4), train=dict(batch_size=6)),
                              r"train.batch_size=6 is not divisible by 8 = replica\(2\) x "
                              r"fsdp\(4\)"),
    "seq vs context": (dict(mesh=dict(fsdp=4, context=2), train=dict(seq_len=31)),
                       r"train.seq_len=31 is not divisible by 2 = context\(2\)"),
    "seq vs sequence parallelism": (
        dict(mesh=dict(fsdp=4, tensor=2), rules="megatron_sp", train=dict(seq_len=33)),
        r"train.seq_len=33 is not divisible by 2 = tensor\(2\)"),
    "context vs devices": (dict(mesh=dict(fsdp=-1, context=3)),
                           r"fixed sizes multiply to 3, which does not divide the 8 devices"),
    # The ring's own checks (model.cp_impl=ring; under auto a layout the ring cannot
    # run takes all-to-all instead, and the start-up line says why).
    "seq vs zigzag ring": (dict(mesh=dict(fsdp=4, context=2), train=dict(seq_len=34),
                                model=dict(cp_impl="ring")),
                           r"train.seq_len=34 is not divisible by 2 x mesh.context\(2\) = 4: "
                           r"model.cp_layout='zigzag' .* e.g. train.seq_len=36, or "
                           r"model.cp_layout='contiguous'"),
    "kv tile vs ring block": (dict(mesh=dict(fsdp=4, context=2), train=dict(seq_len=48),
                                   model=dict(attn_kv_tile=8, cp_impl="ring")),
                              r"model.attn_kv_tile=8 does not divide ring attention's block of "
                              r"12 tokens .* e.g. model.attn_kv_tile=6"),
    "kv tile on one shard": (dict(mesh=dict(fsdp=8), model=dict(attn_impl="ring", attn_kv_tile=5)),
                             r"model.attn_kv_tile=5 does not divide .* block of 16 tokens"),
    "bad kv tile": (dict(mesh=dict(fsdp=8), model=dict(attn_kv_tile=0)),
                    r"model.attn_kv_tile=0 must be an int >= 1"),
    "bad layout": (dict(mesh=dict(fsdp=8), model=dict(cp_layout="striped")),
                   r"model.cp_layout='striped': choose one of \('zigzag', 'contiguous'\)"),
    "bad attention": (dict(mesh=dict(fsdp=8), model=dict(attn_impl="flash")),
                      r"model.attn_impl='flash': choose one of \('auto', 'dense', 'blocked', "
                      r"'tiled', 'ring', 'cudnn', 'pallas'\)"),
    "cudnn on cpu": (dict(mesh=dict(fsdp=8), model=dict(attn_impl="cudnn")),
                     r"model.attn_impl='cudnn' runs on NVIDIA GPUs, and this run's devices are "
                     r"cpu. Use model.attn_impl='auto'"),
    "pallas on cpu": (dict(mesh=dict(fsdp=8), model=dict(attn_impl="pallas")),
                      r"model.attn_impl='pallas' runs on NVIDIA GPUs"),
    "tiled over context": (dict(mesh=dict(fsdp=4, context=2),
                                model=dict(attn_impl="tiled", cp_impl="ring")),
                           r"model.attn_impl='tiled' runs on one context shard, but the rules "
                           r"split the sequence over mesh.context=2. Use model.cp_impl="
                           r"'all_to_all' .* or model.attn_impl='ring'"),
    "all_to_all heads": (dict(mesh=dict(fsdp=2, context=4),
                              model=dict(cp_impl="all_to_all", n_heads=2, n_kv_heads=1)),
                         r"model.cp_impl='all_to_all' gives each of mesh.context=4 shards a "
                         r"slice of the query heads, and each device holds 2"),
    "tiled tile": (dict(mesh=dict(fsdp=8), model=dict(attn_impl="tiled", attn_kv_tile=5)),
                   r"model.attn_kv_tile=5 does not divide half of train.seq_len=32 \(16 "
                   r"tokens, .* e.g. model.attn_kv_tile=4"),
    "offload unrolled": (dict(mesh=dict(fsdp=8), model=dict(remat="offload", scan_layers=False)),
                         r"model.remat='offload' keeps the inputs the layer scan saves in host "
                         r"memory, and model.scan_layers=False unrolls the layers. Unset "
                         r"model.scan_layers, or use model.remat='full'."),
    "heads vs kv heads": (dict(mesh=dict(fsdp=8), model=dict(n_heads=8, n_kv_heads=3)),
                          r"model.n_heads=8 is not a multiple of model.n_kv_heads=3"),
    "odd head dim": (dict(mesh=dict(fsdp=8), model=dict(dim=72, n_heads=8)),
                     r"head_dim=9 .* must be a whole, even number"),
    "unknown preset": (dict(mesh=dict(fsdp=8), model=dict(preset="llama9")),
                       r"model.preset='llama9': choose one of \['llama3_1b', .*'tiny'\] "
                       r"\(the presets of model.family='llama'\)"),
    "unknown rules": (dict(mesh=dict(fsdp=8), rules="fastest"), r"rules='fastest' is not a preset"),
    "bad remat": (dict(mesh=dict(fsdp=8), model=dict(remat="some")), r"model.remat='some'"),
    "bad dtype": (dict(mesh=dict(fsdp=8), model=dict(dtype="fp8")), r"model.dtype='fp8'"),
    "grad_accum not dividing the batch": (
        dict(mesh=dict(fsdp=4, tensor=2), train=dict(grad_accum=3)),
        r"train.grad_accum=3: .* batch_size must be a multiple of 3 x 4 = 12. Use "
        r"train.grad_accum in \[1, 2\]"),
    "micro-batch rows the data axes cannot split": (
        dict(mesh=dict(fsdp=8), train=dict(grad_accum=2)),
        r"train.grad_accum=2: each micro-batch of train.batch_size=8 / 2 rows must split "
        r"evenly over 8 = fsdp\(8\)"),
    "zero grad_accum": (dict(mesh=dict(fsdp=8), train=dict(grad_accum=0)),
                        r"train.grad_accum=0 must be an int >= 1"),
    "loss chunk not dividing seq_len": (dict(mesh=dict(fsdp=8), train=dict(loss_chunk=12)),
                                        r"train.loss_chunk=12 must divide train.seq_len=32 .* "
                                        r"e.g. train.loss_chunk=8"),
    "loss chunk vs context": (
        dict(mesh=dict(fsdp=2, context=4), train=dict(loss_chunk=2)),
        r"train.loss_chunk=2 must divide train.seq_len=32 and be a multiple of 4 = "
        r"context\(4\)"),
    "bad param dtype": (dict(mesh=dict(fsdp=8), model=dict(param_dtype="float16")),
                        r"model.param_dtype='float16': choose one of "
                        r"\('auto', 'float32', 'bfloat16'\)"),
    "adapters without lora": (dict(mesh=dict(fsdp=8), export=dict(adapter_dir="peft")),
                              r"export.adapter_dir='peft' exports LoRA adapters, and "
                              r"model.lora.rank is unset: set model.lora.rank"),
    "bad moment dtype": (dict(mesh=dict(fsdp=8), train=dict(opt_state_dtype="fp8")),
                         r"train.opt_state_dtype='fp8': choose one of \('float32', 'bfloat16'\)"),
    "kv heads neither divided by tensor nor dividing it": (
        dict(mesh=dict(fsdp=2, tensor=4), model=dict(n_heads=12, n_kv_heads=3, dim=96)),
        r"model.n_kv_heads=3 cannot be laid over 4 = tensor\(4\), .* must divide n_kv_heads "
        r"or be a multiple of it .* Use mesh.tensor in \[1, 3, 6\]"),
    "negative steps": (dict(mesh=dict(fsdp=8), train=dict(steps=-1)),
                       r"train.steps=-1 must be an int >= 0"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_raises_config_error(case):
    kwargs, match = CASES[case]
    with pytest.raises(ConfigError, match=match):
        Experiment.from_config(tiny_config(**kwargs))


def test_non_int_size_is_an_error():
    # ConfigDict's type safety already refuses a str for an int field; a config
    # built unlocked (or a float in a fresh dict) still reaches our check.
    c = tiny_config()
    c.mesh = {"replica": 1, "fsdp": 8.0, "context": 1, "tensor": 1}
    with pytest.raises(ConfigError, match=r"mesh.fsdp=8.0 must be an int"):
        Experiment.from_config(c)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_unknown_keys_are_errors():
    c = tiny_config(mesh=dict(fsdp=8))
    c.train.stpes = 3
    with pytest.raises(ConfigError, match=r"unknown config key 'train.stpes'. Did you mean "
                                          r"train.steps\?"):
        Experiment.from_config(c)
    c = tiny_config(mesh=dict(fsdp=8))
    c.optimizer = {"lr": 1.0}
    with pytest.raises(ConfigError, match=r"unknown config key 'optimizer'"):
        Experiment.from_config(c)


def test_validation_compiles_nothing():
    compiles = []

    def listener(event, duration, **kwargs):
        if "backend_compile" in event:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        exp = Experiment.from_config(tiny_config(mesh=dict(fsdp=4, tensor=2)))
        assert compiles == []
        exp.compiled_step  # noqa: B018 -- the listener does see a compile
        assert compiles
    finally:
        jax.monitoring.clear_event_listeners()
