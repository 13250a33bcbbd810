"""Reading and writing the fields of a Hugging Face ``config.json`` that the decoder
families share (dims, norms, rotary embeddings, sliding windows); each family's
module adds and checks its own.

Readers see config.json with the family's ``hf_defaults`` filled in for absent keys
(``Family.read_config_json``), so every key they read is in that table and none has
a default of its own here."""

from __future__ import annotations

from typing import Any

from ndjax.models.decoder import FULL, SLIDING, DecoderConfig
from ndjax.models.layers import ROPE_TYPES, RopeScaling
from ndjax.runtime.errors import ConfigError


def config_error(where: str, key: str, fix: str = "") -> ConfigError:
    """One line naming the checkpoint, the config.json field and the fix."""
    return ConfigError(f"model.init_from={where!r}: config.json {key}. {fix}".strip())


# Keys without a default: transformers' (one size of model) is never a checkpoint's.
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "intermediate_size")

# transformers' values for absent keys that LlamaConfig and the families after it
# share. None: from other keys, as for null (kv heads: the heads; head_dim: hidden_size
# over the heads). max_position_embeddings: the original length of llama3 rope scaling.
DEFAULTS = dict(num_key_value_heads=None, head_dim=None, rope_theta=10_000.0,
                rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=2048)


def number(c: dict, key: str, where: str) -> float:
    """config.json's ``key``, a number > 0."""
    value = c[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise config_error(where, f"{key}={value!r} must be a number > 0", "Fix config.json.")
    return float(value)


def require(c: dict, where: str, family: str, **wanted: Any) -> None:
    """Refuses a config.json whose fields differ from what the family implements."""
    for key, want in wanted.items():
        if c[key] != want:
            raise config_error(where, f"{key}={c[key]!r}", f"ndjax's {family} has {key}={want!r}.")


def read_rope(params: dict, c: dict, where: str,
              theta_key: str = "rope_theta") -> tuple[float, RopeScaling | None]:
    """(theta, scaling) of one set of rope parameters (transformers 5's rope_parameters,
    or 4.x's rope_scaling with the base at the top level, as ``theta_key``). Absent keys
    take transformers' values: original_max_position_embeddings a top-level one, else
    max_position_embeddings; yarn's beta_fast 32, beta_slow 1, truncate true, and a null
    factor max_position_embeddings / original_max_position_embeddings."""
    theta = (number(params, "rope_theta", where) if "rope_theta" in params
             else number(c, theta_key, where))
    kind = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise config_error(where, f"partial_rotary_factor={params['partial_rotary_factor']}",
                           "ndjax rotates the whole head; only 1.0 is supported.")
    if kind == "default":
        return theta, None
    if kind not in ROPE_TYPES:
        raise config_error(where, f"rope type {kind!r} is not supported",
                           f"ndjax implements default and {' and '.join(ROPE_TYPES)} rotary "
                           "embeddings.")
    if "factor" not in params:
        raise config_error(where, f"{kind} rope scaling lacks its factor", "Add it.")
    if kind == "linear":
        return theta, RopeScaling(factor=float(params["factor"]), rope_type="linear")
    # transformers prefers a top-level original_max_position_embeddings (Phi 3's).
    original = c.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings", c["max_position_embeddings"])
    if isinstance(original, bool) or not isinstance(original, (int, float)) or original < 1:
        raise config_error(where, f"original_max_position_embeddings={original!r} must be a "
                           "positive int", "Fix config.json.")
    if kind == "yarn":
        return theta, _read_yarn(params, c, where, int(original))
    missing = [k for k in ("low_freq_factor", "high_freq_factor") if k not in params]
    if missing:
        raise config_error(where, f"llama3 rope scaling lacks {missing}",
                           "Add them to config.json.")
    return theta, RopeScaling(
        factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(original))


def _read_yarn(params: dict, c: dict, where: str, original: int) -> RopeScaling:
    factor = params["factor"]
    if factor is None:  # transformers: the ratio of the lengths
        factor = number(c, "max_position_embeddings", where) / original
    values = {}
    for key in ("factor", "attention_factor", "beta_fast", "beta_slow", "mscale",
                "mscale_all_dim"):
        value = factor if key == "factor" else params.get(key)
        positive = key in ("factor", "attention_factor")  # the others: 0 means unset
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or value < 0 or (positive and value == 0)):
            raise config_error(where, f"yarn rope scaling's {key}={value!r} must be a number "
                               f"{'>' if positive else '>='} 0", "Fix config.json.")
        values[key] = None if value is None else float(value)
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise config_error(where, f"yarn rope scaling's truncate={truncate!r} must be true or "
                           "false", "Fix config.json.")
    # transformers reads a beta of 0 or null as its default.
    return RopeScaling(factor=values["factor"], original_max_position_embeddings=original,
                       rope_type="yarn", beta_fast=values["beta_fast"] or 32.0,
                       beta_slow=values["beta_slow"] or 1.0, truncate=truncate,
                       attention_factor=values["attention_factor"], mscale=values["mscale"],
                       mscale_all_dim=values["mscale_all_dim"])


def rope_parameters(c: dict) -> dict:
    # Like transformers 5, prefer a 4.x rope_scaling where both are present.
    return c.get("rope_scaling") or c.get("rope_parameters") or {}


def read_dims(c: dict, where: str) -> dict:
    """The DecoderConfig fields every family's config.json has (rotary embeddings: the
    global layers')."""
    ints = {}
    for key in REQUIRED:
        if not isinstance(c.get(key), int) or c[key] < 1:
            raise config_error(where, f"{key}={c.get(key)!r} must be a positive int",
                               "Fix config.json.")
        ints[key] = c[key]
    heads = ints["num_attention_heads"]
    params = rope_parameters(c)
    if FULL in params:  # per layer type (Gemma 3)
        params = params[FULL]
    theta, scaling = read_rope(params, c, where)
    return dict(vocab_size=ints["vocab_size"], dim=ints["hidden_size"],
                n_layers=ints["num_hidden_layers"], n_heads=heads,
                n_kv_heads=c["num_key_value_heads"] or heads,
                ffn_dim=ints["intermediate_size"],
                head_dim=c["head_dim"] or ints["hidden_size"] // heads, rope_theta=theta,
                rope_scaling=scaling, rms_norm_eps=number(c, "rms_norm_eps", where),
                tie_embeddings=bool(c["tie_word_embeddings"]))


def read_window(c: dict, where: str, n_layers: int) -> dict:
    """sliding_window and sliding_window_pattern from config.json's ``sliding_window``
    and ``layer_types`` (absent: every layer local when there is a window)."""
    window, types = c["sliding_window"], c["layer_types"]
    if types is not None and SLIDING not in types:
        window = None
    if not window:
        return dict(sliding_window=None, sliding_window_pattern=None)
    if types is None or FULL not in types:
        return dict(sliding_window=int(window), sliding_window_pattern=None)
    every = list(types).index(FULL) + 1
    if list(types) != [FULL if (i + 1) % every == 0 else SLIDING for i in range(n_layers)]:
        raise config_error(where, f"layer_types={types!r}",
                           "ndjax's windowed layers repeat a pattern: every n-th layer global.")
    return dict(sliding_window=int(window), sliding_window_pattern=every)


def write_rope(theta: float, scaling: RopeScaling | None) -> dict:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if scaling is not None:
        rope.update(scaling.as_dict())
    return rope


def write_dims(cfg: DecoderConfig) -> dict:
    """config.json's shared fields for ``cfg`` (rotary: transformers 5's rope_parameters
    and 4.x's rope_theta / rope_scaling, both)."""
    rope = write_rope(cfg.rope_theta, cfg.rope_scaling)
    out = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
               num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
               num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.hd,
               rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_embeddings,
               rope_theta=cfg.rope_theta, rope_parameters=rope,
               rope_scaling=None if cfg.rope_scaling is None else dict(rope))
    if cfg.sliding_window:
        out.update(sliding_window=cfg.sliding_window, layer_types=list(cfg.types))
    return out


def default_positions(cfg: DecoderConfig) -> int:
    """max_position_embeddings when neither the source nor the run says."""
    s = cfg.rope_scaling
    if s is not None and s.rope_type in ("llama3", "yarn"):
        return int(s.original_max_position_embeddings * s.factor)
    return 8192


def read_aux_loss(c: dict, where: str) -> dict:
    """The load-balancing loss's weight in the training loss, as transformers trains the
    checkpoint: ``router_aux_loss_coef`` where ``output_router_logits`` is true, else 0
    (transformers adds the loss only then; the released Mixtral and Qwen MoE files set
    it false). A config's model.router_aux_loss_coef overrides it (hf.override_dims)."""
    on, coef = c["output_router_logits"], c["router_aux_loss_coef"]
    if not isinstance(on, bool):
        raise config_error(where, f"output_router_logits={on!r} must be true or false",
                           "Fix config.json.")
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0:
        raise config_error(where, f"router_aux_loss_coef={coef!r} must be a number >= 0",
                           "Fix config.json.")
    return {"router_aux_loss_coef": float(coef) if on else 0.0}


def write_aux_loss(cfg: DecoderConfig) -> dict:
    """``read_aux_loss``'s fields: a load-balancing loss in the loss is written as
    output_router_logits true and its weight; none as output_router_logits false and no
    weight, so that an export keeps its source's (transformers' default without one),
    which transformers then leaves out of the loss as ndjax did."""
    coef = cfg.router_aux_loss_coef
    return ({"output_router_logits": True, "router_aux_loss_coef": coef} if coef > 0
            else {"output_router_logits": False})
