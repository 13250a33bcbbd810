"""YaRN rotary scaling (GPT-OSS, DeepSeek V3) against transformers: the inverse
frequencies, the attention factor, the cos/sin tables; config.json read and written
back; model.rope_scaling's checks."""

import dataclasses

import numpy as np
import pytest
import torch
from transformers import DeepseekV3Config, GptOssConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

from ndjax.config import ModelSettings
from ndjax.models import hf_config
from ndjax.models.layers import Rope, RopeScaling, rope_frequencies, rope_tables
from ndjax.runtime.errors import ConfigError

GPT_OSS = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
               original_max_position_embeddings=4096)
DEEPSEEK = dict(rope_type="yarn", factor=40.0, beta_fast=32, beta_slow=1, mscale=1.0,
                mscale_all_dim=1.0, original_max_position_embeddings=4096)


def gpt_oss_config(**rope) -> GptOssConfig:
    return GptOssConfig(head_dim=64, rope_parameters={"rope_theta": 150_000.0, **GPT_OSS,
                                                      **rope})


def deepseek_config(positions: int = 163_840, **rope) -> DeepseekV3Config:
    # The rotary dim is qk_rope_head_dim (DeepseekV3Config sets head_dim to it).
    return DeepseekV3Config(qk_rope_head_dim=64, max_position_embeddings=positions,
                            rope_parameters={"rope_theta": 10_000.0, **DEEPSEEK, **rope})


def read(config) -> tuple[float, RopeScaling]:
    """ndjax's reading of a transformers config's rope_parameters."""
    c = config.to_dict()
    return hf_config.read_rope(hf_config.rope_parameters(c), c, "/ckpt")


CASES = {
    "gpt_oss": gpt_oss_config,
    "deepseek_v3": deepseek_config,
    "truncated": lambda: gpt_oss_config(truncate=True),
    "attention_factor": lambda: deepseek_config(attention_factor=0.8),
    "mscale": lambda: deepseek_config(mscale=0.707, mscale_all_dim=1.2),
    "factor_null": lambda: deepseek_config(65_536, factor=None),  # 16
    "beta_0": lambda: gpt_oss_config(beta_fast=0, beta_slow=4.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_frequencies_and_attention_factor_equal_transformers(case):
    config = CASES[case]()
    inv, attention = ROPE_INIT_FUNCTIONS["yarn"](config)
    theta, scaling = read(config)
    ours = rope_frequencies(Rope(theta, scaling), config.head_dim)
    assert ours.dtype == np.float32
    np.testing.assert_allclose(np.asarray(ours), inv.numpy(), rtol=1e-6, atol=0)
    assert scaling.attention_scaling == pytest.approx(attention, rel=1e-12)


def test_the_attention_factor_is_1_but_for_yarn():
    assert RopeScaling(factor=8.0).attention_scaling == 1.0
    assert RopeScaling(factor=8.0, rope_type="linear").attention_scaling == 1.0
    assert RopeScaling(**GPT_OSS).attention_scaling > 1.0
    # DeepSeek V3's equal mscales cancel: cos and sin stay unscaled.
    assert RopeScaling(**DEEPSEEK).attention_scaling == 1.0


def test_tables_equal_gpt_oss_rotary_embedding():
    config = gpt_oss_config()
    positions = np.array([[0, 1, 17, 4095, 4096, 50_000, 131_071]])
    cos_t, sin_t = GptOssRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32),
                                                  torch.from_numpy(positions))
    rope = Rope(*read(config))
    cos, sin = rope_tables(rope, config.head_dim, positions)
    # float32 powers differ by an ulp or so between XLA and torch (the frequencies agree
    # to 1e-6): the angles, position x frequency, by as much of themselves.
    angles = positions[..., None] * np.asarray(rope_frequencies(rope, config.head_dim))
    atol = rope.scaling.attention_scaling * 1e-6 * angles + 1e-6
    half = config.head_dim // 2  # GPT-OSS keeps one half; ndjax repeats it
    for ours, theirs in ((cos, cos_t), (sin, sin_t)):
        ours = np.asarray(ours)
        np.testing.assert_array_equal(ours[..., :half], ours[..., half:])
        assert np.all(np.abs(ours[..., :half] - theirs.numpy()) <= atol)
        assert np.abs(ours[..., :half]).max() > 1.3  # scaled by the attention factor


@pytest.mark.parametrize("form", ["rope_parameters", "rope_scaling_4x"])
def test_config_json_round_trips(form):
    if form == "rope_parameters":
        c = dict(rope_parameters={"rope_theta": 150_000.0, **GPT_OSS},
                 max_position_embeddings=131_072)
    else:  # 4.x: "type", the base at the top level, optional keys absent
        c = dict(rope_theta=10_000.0, max_position_embeddings=163_840, rope_scaling=dict(
            type="yarn", factor=40, mscale=1.0, mscale_all_dim=1.0,
            original_max_position_embeddings=4096))
    theta, scaling = hf_config.read_rope(hf_config.rope_parameters(c), c, "/ckpt")
    written = hf_config.write_rope(theta, scaling)
    assert written["rope_type"] == "yarn" and "type" not in written
    assert "attention_factor" not in written  # absent stays absent
    again = hf_config.read_rope(written, {"max_position_embeddings": 1}, "/ckpt")
    assert again == (theta, scaling)
    if form == "rope_parameters":
        assert written == {"rope_theta": 150_000.0, **GPT_OSS}
    else:
        assert (scaling.beta_fast, scaling.beta_slow, scaling.truncate) == (32.0, 1.0, True)


def test_absent_original_length_and_null_factor_read_as_transformers():
    c = dict(rope_theta=1e4, max_position_embeddings=8192,
             rope_parameters=dict(rope_type="yarn", factor=None))
    _, scaling = hf_config.read_rope(hf_config.rope_parameters(c), c, "/ckpt")
    assert scaling.original_max_position_embeddings == 8192 and scaling.factor == 1.0
    c["rope_parameters"]["original_max_position_embeddings"] = 2048
    _, scaling = hf_config.read_rope(hf_config.rope_parameters(c), c, "/ckpt")
    assert scaling.factor == 4.0


@pytest.mark.parametrize("scaling", [
    RopeScaling(**GPT_OSS), RopeScaling(**DEEPSEEK, attention_factor=0.9),
    RopeScaling(factor=8.0), RopeScaling(factor=2.0, rope_type="linear")])
def test_as_dict_gives_the_scaling_back(scaling):
    assert RopeScaling(**scaling.as_dict()) == scaling


def test_llama3_and_linear_write_only_their_keys():
    assert hf_config.write_rope(5e5, RopeScaling(factor=8.0)) == dict(
        rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=8192)
    assert hf_config.write_rope(1e6, RopeScaling(factor=8.0, rope_type="linear")) == dict(
        rope_type="linear", rope_theta=1e6, factor=8.0)


@pytest.mark.parametrize("key, value, says", [
    ("factor", 0, "yarn rope scaling's factor=0 must be a number > 0"),
    ("beta_fast", "32", "yarn rope scaling's beta_fast='32' must be a number >= 0"),
    ("attention_factor", -1.0, "yarn rope scaling's attention_factor=-1.0 must be a number > 0"),
    ("truncate", "no", "yarn rope scaling's truncate='no' must be true or false"),
    ("original_max_position_embeddings", None, "original_max_position_embeddings=None must be "
                                               "a positive int"),
])
def test_a_bad_config_json_yarn_value_is_refused(key, value, says):
    c = dict(rope_theta=1e4, max_position_embeddings=8192,
             rope_parameters={**GPT_OSS, key: value})
    with pytest.raises(ConfigError, match=r"model.init_from='/ckpt': config.json " + says):
        hf_config.read_rope(hf_config.rope_parameters(c), c, "/ckpt")


@pytest.mark.parametrize("scaling", [
    dict(GPT_OSS), dict(DEEPSEEK), dict(DEEPSEEK, attention_factor=1.2),
    dataclasses.asdict(RopeScaling(**GPT_OSS)),  # as a run's workdir saves it
    dataclasses.asdict(RopeScaling(factor=8.0)), {"factor": 4.0}, {},
])
def test_model_rope_scaling_takes_yarn(scaling):
    ModelSettings(rope_scaling=scaling).check()


@pytest.mark.parametrize("scaling, says", [
    (dict(GPT_OSS, beta_fastt=3), r"unknown keys \['beta_fastt'\]; it takes"),
    (dict(rope_type="ntk"), r"rope_type='ntk'; choose one of \('llama3', 'linear', 'yarn'\)"),
    (dict(GPT_OSS, truncate="no"), r"truncate='no' must be True or False"),
    (dict(GPT_OSS, beta_fast=0), r"beta_fast=0 must be a number > 0\.$"),
    (dict(GPT_OSS, mscale=-1.0), r"mscale=-1.0 must be a number > 0 or None \(unset\)"),
    (dict(GPT_OSS, original_max_position_embeddings=4096.5),
     r"original_max_position_embeddings=4096.5 must be an int >= 1"),
    (dict(factor=32.0, truncate=False), r"truncate=False is not read by rope_type='llama3', "
                                        r"which takes \['factor', .*\]; drop it or set rope_type"),
    (dict(factor=8.0, low_freq_factor=4.0), r"high_freq_factor=4.0 must exceed "
                                             r"low_freq_factor=4.0"),
])
def test_model_rope_scaling_refuses_bad_values_in_one_line(scaling, says):
    with pytest.raises(ConfigError, match=r"^model.rope_scaling[:=].*" + says) as e:
        ModelSettings(rope_scaling=scaling).check()
    assert "\n" not in str(e.value)
