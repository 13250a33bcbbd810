"""Axolotl's ``rl: grpo`` as ndjax's train.objective=grpo and its grpo section, by the
meaning of TRL's GRPOConfig, to which Axolotl hands its ``trl:`` settings
(``GRPOStrategy.set_training_args_kwargs``). ndjax samples the completions itself, on
the training mesh with the weights it trains: the vLLM settings have no counterpart, and
the settings that change the sampling or the loss beyond what ndjax's GRPO does are
refused, one line each. The datasets are read in ``datasets`` (records that already
hold a prompt: ndjax cannot run Axolotl's Python transforms)."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any

from ndjax.axolotl.fields import Fields, Out, refusal, show
from ndjax.config import GRPO_LOSSES, GRPOSettings

# TRL 1.16's GRPOConfig defaults, where Axolotl leaves a setting unset.
TRL = {"num_generations": 8, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "loss_type": "dapo",
       "epsilon": 0.2, "beta": 0.0}
# Axolotl's TRLConfig (utils/schemas/trl.py), and the key its GRPO strategy reads beside.
KNOWN = frozenset("""beta max_completion_length use_vllm vllm_mode vllm_server_host
    vllm_server_port vllm_server_timeout vllm_guided_decoding_regex reward_funcs reward_weights
    generation_batch_size num_generations log_completions num_completions_to_print
    importance_sampling_level sync_ref_model ref_model_mixup_alpha ref_model_sync_steps
    scale_rewards temperature top_p top_k min_p repetition_penalty generation_kwargs
    chat_template_kwargs num_iterations epsilon epsilon_high use_liger_loss loss_type
    mask_truncated_completions vllm_enable_sleep_mode rollout_func multi_objective_aggregation
    use_data_producer async_prefetch prefetch_depth vllm_sync_interval streaming_partial_batch
    streaming_min_groups vllm_importance_sampling_correction vllm_importance_sampling_mode
    vllm_importance_sampling_cap off_policy_mask_threshold use_bias_correction_kl
    reward_num_workers replay_buffer_size replay_recompute_logps reroll_start_fraction
    reroll_max_groups skip_zero_advantage_batches vllm_lora_sync
    reward_processing_classes""".split())
# Whether ndjax's GRPO reuses a batch of rollouts for several steps (TRL's num_iterations).
ITERATIONS = "num_iterations" in {f.name for f in dataclasses.fields(GRPOSettings)}
SAMPLER = "ndjax samples the completions itself, on the training mesh with the weights it " \
          "trains (no vLLM server or engine)"
# Axolotl's TRLConfig fields with no meaning here, and why (each listed as not mapped).
UNUSED = {
    "use_vllm": SAMPLER, "vllm_mode": SAMPLER, "vllm_server_host": SAMPLER,
    "vllm_server_port": SAMPLER, "vllm_server_timeout": SAMPLER,
    "vllm_enable_sleep_mode": SAMPLER, "vllm_lora_sync": SAMPLER,
    "vllm_sync_interval": SAMPLER,
    "vllm_importance_sampling_correction": "it corrects for vLLM sampling with other weights "
                                           "than the policy's; " + SAMPLER,
    "vllm_importance_sampling_mode": "it corrects for vLLM sampling with other weights than "
                                     "the policy's; " + SAMPLER,
    "vllm_importance_sampling_cap": "it corrects for vLLM sampling with other weights than "
                                    "the policy's; " + SAMPLER,
    "log_completions": "ndjax logs the rewards' statistics, not the completions' text",
    "num_completions_to_print": "ndjax logs the rewards' statistics, not the completions' "
                                "text",
    "use_liger_loss": "a fused kernel for the same loss; ndjax computes it on the "
                      "log-probabilities of its own chunked LM head",
    "use_data_producer": "Axolotl's data-producer protocol for generating rollouts; ndjax "
                         "samples each step's completions in the step's loop",
    "prefetch_depth": "read with async_prefetch only", "streaming_partial_batch":
    "how Axolotl's async trainer schedules scoring; ndjax scores each step's completions "
    "together", "streaming_min_groups": "how Axolotl's async trainer schedules scoring; "
    "ndjax scores each step's completions together",
    "reward_num_workers": "ndjax calls the reward functions in its own process",
    "vllm_guided_decoding_regex": "read with use_vllm only",
}


def settings(f: Fields, out: Out) -> None:
    """train.objective=grpo's grpo.* settings from ``trl:`` (and Axolotl's beta sources),
    the reference (grpo.beta > 0), the batch's groups; every other ``trl:`` key listed or
    refused. train.seq_len is checked against the completion length by ``lengths``."""
    raw = f.value("trl")
    if raw is not None and not isinstance(raw, Mapping):
        out.problem(refusal("trl", raw, "a mapping of TRL's settings", ", e.g. trl: "
                            "{num_generations: 8, reward_funcs: [rewards.accuracy]}"))
        raw = None
    t = f.child(raw or {}, "trl.")
    _sampling(t, out)
    _rewards(t, out)
    _loss(t, out)
    beta = _beta(f, t, out)
    _reference(f, out, beta)
    _refused(t, out, beta)
    groups = out.overrides["grpo.num_generations"]
    batch = out.overrides.get("train.batch_size")
    _generation_batch(t, out, batch)
    refused = t.has("num_generations") and t.raw["num_generations"] != groups
    if isinstance(batch, int) and batch % groups and not refused:
        micro = f.raw.get("micro_batch_size") or 1
        accum = f.raw.get("gradient_accumulation_steps") or 1
        named = f"trl.num_generations: {groups}" if t.has("num_generations") else \
            f"trl.num_generations unset (TRL's {groups})"
        out.problem(f"{named} does not divide the batch, "
                    f"{batch} completions (micro_batch_size {micro} x "
                    f"gradient_accumulation_steps {accum} x the data-parallel GPUs); TRL "
                    "refuses that too: make the batch a multiple of num_generations (e.g. "
                    "gradient_accumulation_steps) or use a divisor of it.")
    if t.raw.get("use_vllm") and t.raw.get("vllm_guided_decoding_regex"):
        out.problem(refusal("trl.vllm_guided_decoding_regex", t.raw["vllm_guided_decoding_regex"],
                            "unset", "; ndjax's sampler has no guided decoding: remove it"))
    _rest(t, out)


def _rest(t: Fields, out: Out) -> None:
    """Every ``trl:`` key that no setting, listing or problem names: listed, with why."""
    named = " ".join(out.notes.values())
    for key, value in t.raw.items():
        field = f"trl.{key}"
        if field in out.unmapped or re.search(rf"\b{re.escape(field)}\b", named) or any(
                p.startswith(f"{field}:") or p.startswith(f"{field} ") for p in out.problems):
            continue
        if key in UNUSED:
            why = UNUSED[key]
        elif value in (None, False, "", [], {}):
            why = "off, nothing to map"
        elif key in KNOWN:
            why = "ndjax has no counterpart"
        else:
            why = "not a setting of Axolotl's trl: section (Axolotl ignores it)"
        out.skip(field, value, why)


def _sampling(t: Fields, out: Out) -> None:
    """How completions are sampled: num_generations, max_completion_length, temperature,
    top_p, top_k (TRL's defaults where unset); min_p and repetition_penalty are not
    ndjax's sampler's and refused where they change it."""
    groups = t.integer("num_generations", None, minimum=2)
    out.set("grpo.num_generations", TRL["num_generations"] if groups is None else groups,
            _note(t, "num_generations", "TRL's default 8") + ": completions per prompt")
    length = t.integer("max_completion_length", None, minimum=1)
    if length is None and not t.has("max_completion_length"):
        out.problem("trl.max_completion_length is not set: Axolotl then hands TRL None (the "
                    "model's generation_config decides how long completions get); set it, "
                    "e.g. trl.max_completion_length: 256.")
    if length is not None:
        out.set("grpo.max_completion_length", length, "trl.max_completion_length")
    temperature = t.number("temperature", None)
    if temperature is not None and temperature <= 0:
        out.problem(refusal("trl.temperature", t.raw["temperature"], "a number > 0",
                            "; e.g. trl.temperature: 1.0"))
        temperature = None
    out.set("grpo.temperature", TRL["temperature"] if temperature is None else temperature,
            _note(t, "temperature", "TRL's default 1.0") + " (the sampler's and the "
            "log-probabilities')")
    top_p = t.number("top_p", None, maximum=1.0)
    if top_p is not None and top_p <= 0:
        out.problem(refusal("trl.top_p", t.raw["top_p"], "a number > 0 and <= 1"))
        top_p = None
    out.set("grpo.top_p", TRL["top_p"] if top_p is None else top_p,
            _note(t, "top_p", "TRL's default 1.0"))
    top_k = t.integer("top_k", None)
    out.set("grpo.top_k", TRL["top_k"] if top_k is None else top_k,
            _note(t, "top_k", "TRL's default 0: off"))
    min_p = t.number("min_p", None, maximum=1.0)
    if min_p:
        out.problem(refusal("trl.min_p", t.raw["min_p"], "unset or 0", "; ndjax's sampler "
                            "has temperature, top_p and top_k, no min-p filtering: remove it"))
    elif t.has("min_p"):
        out.skip("trl.min_p", t.raw["min_p"], "0: no min-p filtering, as ndjax samples")
    penalty = t.number("repetition_penalty", None)
    if penalty is not None and penalty != 1:
        out.problem(refusal("trl.repetition_penalty", t.raw["repetition_penalty"], "1 (or "
                            "unset)", "; ndjax's sampler has no repetition penalty: remove it"))
    elif penalty is not None:
        out.skip("trl.repetition_penalty", t.raw["repetition_penalty"], "1: no penalty, as "
                 "ndjax samples")
    for key, what in (("generation_kwargs", "more sampling arguments"),
                      ("chat_template_kwargs", "arguments of the prompts' chat template")):
        value = t.value(key)
        if value:
            out.problem(refusal(f"trl.{key}", value, "unset", f" ({what}); ndjax has no "
                                "counterpart: remove it" + ("" if key == "generation_kwargs"
                                                            else ", or save a chat template "
                                                            "that renders the prompts as "
                                                            "you want (chat_template_jinja)")))


def _note(t: Fields, key: str, unset: str) -> str:
    return f"trl.{key}" if t.has(key) else f"trl.{key} unset: {unset}"


def _rewards(t: Fields, out: Out) -> None:
    """grpo.reward_funcs: trl.reward_funcs ("module.fn" strings) joined with commas;
    a reward model (a hub id or a directory) is refused. grpo.reward_weights: one each."""
    funcs = t.value("reward_funcs")
    names = [funcs] if isinstance(funcs, str) else funcs
    if not names:
        out.problem("trl.reward_funcs is not set: GRPO scores its completions with reward "
                    "functions; list them as module.function names importable from the "
                    "directory you run in, e.g. trl.reward_funcs: [rewards.accuracy_reward].")
        return
    if not isinstance(names, list) or not all(isinstance(n, str) and n.strip() for n in names):
        out.problem(refusal("trl.reward_funcs", funcs, "a list of module.function names",
                            ", e.g. [rewards.accuracy_reward]"))
        return
    models = [n for n in names if "/" in n or os.path.isdir(n) or "." not in n.strip(".")]
    if models:
        out.problem(refusal("trl.reward_funcs", funcs, "a list of module.function names",
                            f"; {show(models[0])} is a reward model (or no module.function "
                            "name), and ndjax's GRPO scores with Python functions only: "
                            "write a function that calls your scorer"))
        return
    out.set("grpo.reward_funcs", ",".join(n.strip() for n in names), "trl.reward_funcs "
            "(module.function names, imported from the directory you run in, as Axolotl "
            "does)")
    weights = t.value("reward_weights")
    if weights is None:
        return
    ok = isinstance(weights, list) and all(
        isinstance(w, int | float) and not isinstance(w, bool) for w in weights)
    if not ok or len(weights) != len(names):
        out.problem(refusal("trl.reward_weights", weights, f"a list of {len(names)} "
                            f"number{'s' if len(names) > 1 else ''}, one for each of "
                            "trl.reward_funcs", ""))
        return
    out.set("grpo.reward_weights", tuple(float(w) for w in weights), "trl.reward_weights")


def _loss(t: Fields, out: Out) -> None:
    """loss_type, epsilon, epsilon_high, scale_rewards, mask_truncated_completions."""
    kind = t.value("loss_type")
    if kind is not None and kind not in GRPO_LOSSES:
        out.problem(refusal("trl.loss_type", kind, f"one of {', '.join(GRPO_LOSSES)}",
                            "; TRL's other GRPO losses (cispo, sapo, luspo, vespo) are not "
                            "built in ndjax"))
        kind = None
    out.set("grpo.loss_type", kind or TRL["loss_type"], _note(t, "loss_type", "TRL's default "
                                                              "dapo"))
    eps = t.number("epsilon", None, below=1.0)
    if eps is not None and eps <= 0:
        out.problem(refusal("trl.epsilon", t.raw["epsilon"], "a number > 0 and < 1"))
        eps = None
    out.set("grpo.epsilon", TRL["epsilon"] if eps is None else eps,
            _note(t, "epsilon", "TRL's default 0.2") + ": the ratio's lower clip, 1 - epsilon")
    high = t.number("epsilon_high", None)
    if high:
        out.set("grpo.epsilon_high", high, "trl.epsilon_high: the upper clip, 1 + "
                "epsilon_high")
    elif high is not None:  # TRL's upper clip 1; ndjax's 0 means epsilon
        out.problem(refusal("trl.epsilon_high", t.raw["epsilon_high"], "> 0 (or unset: "
                            "epsilon)", "; ndjax reads 0 as epsilon's clip"))
    scale = t.value("scale_rewards")
    mapped = {True: "group", False: "none", "group": "group", "batch": "batch",
              "none": "none"}.get(scale, None) if isinstance(scale, bool | str) else None
    if scale is not None and mapped is None:
        out.problem(refusal("trl.scale_rewards", scale, "true, false, group, batch or none"))
    out.set("grpo.scale_rewards", mapped or "group", (
        f"trl.scale_rewards {show(scale)}" if scale is not None else
        "trl.scale_rewards unset: Axolotl's true") + ": " + {
            "group": "rewards minus their group's mean, over the group's std (TRL's true)",
            "batch": "rewards minus their group's mean, over the batch's std",
            "none": "rewards minus their group's mean, unscaled (TRL's false)"}[mapped or "group"])
    masked = t.flag("mask_truncated_completions", None)
    if masked is not None:
        out.set("grpo.mask_truncated_completions", masked, "trl.mask_truncated_completions")


def _beta(f: Fields, t: Fields, out: Out) -> float:
    """grpo.beta (the KL term's weight): trl.beta, else rl_beta, else orpo_alpha, as
    Axolotl's builder hands any rl its beta; unset: TRL's 0 (no reference model)."""
    sources = (("trl.beta", t, "beta"), ("rl_beta", f, "rl_beta"),
               ("orpo_alpha", f, "orpo_alpha"))
    used = None
    for name, where, key in sources:
        value = where.value(key)
        if value is None:
            continue
        if used is not None:
            out.skip(name, value, f"{used[0]} is set, and Axolotl reads it first")
            continue
        number = where.number(key, None)
        used = (name, TRL["beta"] if number is None else number)
    beta = TRL["beta"] if used is None else used[1]
    out.set("grpo.beta", beta, (f"{used[0]}" if used else "trl.beta unset: TRL's default 0") +
            (": the KL term's weight (k3, bias-corrected as TRL's)" if beta else
             ": no KL term, and no reference model"))
    return beta


def _reference(f: Fields, out: Out, beta: float) -> None:
    """GRPO's reference, where grpo.beta > 0: TRL's GRPOTrainer compares with the policy's
    PeftModel with its adapters disabled (lora_model_dir's too: it adds no ``ref``
    adapter, unlike its DPO), else with a second copy of base_model."""
    separate = f.value("rl_adapter_ref_model")
    for key in ("precompute_ref_log_probs",):
        if f.value(key):
            out.skip(key, True, "Axolotl passes it to rl: dpo and ipo only")
    if not beta:
        if separate:
            out.skip("rl_adapter_ref_model", separate, "grpo.beta is 0: no reference model")
        return
    adapters = f.raw.get("adapter") in ("lora", "qlora")
    saved = bool(f.raw.get("lora_modules_to_save"))
    if adapters and f.raw.get("lora_model_dir") and not saved:
        out.set("preference.reference", "adapters_off", "TRL's GRPO reference under a "
                "PeftModel: base_model with the adapters off, lora_model_dir's trained "
                "ones too")
    elif adapters:
        note = "auto: base_model with the adapters off, TRL's GRPO reference under LoRA"
        if saved:
            note += (" (lora_modules_to_save's modules as they start: initial_adapters" +
                     ("; TRL's reference has lora_model_dir's adapters off, ndjax's on)"
                      if f.raw.get("lora_model_dir") else ")"))
        out.set("preference.reference", "auto", note)
    else:
        out.set("preference.reference", "auto", "auto: a frozen copy of base_model's "
                "weights, as TRL loads a second model")
    if separate and adapters:
        out.notes["preference.reference"] += ("; rl_adapter_ref_model: Axolotl loads "
                                              "base_model again as the reference, the same "
                                              "weights")
    elif separate:
        out.skip("rl_adapter_ref_model", separate, "no adapter: the reference is a copy of "
                 "base_model either way")


def _refused(t: Fields, out: Out, beta: float) -> None:
    """The settings that change GRPO's math in ways ndjax's GRPO does not: one line each
    where they are on; listed where they are off."""
    iterations = t.integer("num_iterations", None, minimum=1)
    if iterations is not None and iterations > 1 and ITERATIONS:
        out.set("grpo.num_iterations", iterations, "trl.num_iterations: optimizer steps on "
                "each batch of rollouts (GRPO's mu)")
    elif iterations is not None and iterations > 1:
        out.problem(refusal("trl.num_iterations", iterations, "1 (or unset)", "; ndjax takes "
                            "one optimizer step on each batch of rollouts: remove it"))
    elif iterations is not None:
        out.skip("trl.num_iterations", iterations, "1: one step on each batch of rollouts, as "
                 "ndjax does")
    level = t.value("importance_sampling_level")
    if level not in (None, "token"):
        out.problem(refusal("trl.importance_sampling_level", level, "token (or unset)",
                            "; sequence-level ratios (GSPO) are not built in ndjax"))
    elif level is not None:
        out.skip("trl.importance_sampling_level", level, "token: ndjax's ratios are "
                 "per token")
    sync = t.flag("sync_ref_model", None)
    if sync:
        out.problem(refusal("trl.sync_ref_model", True, "false", "; ndjax's reference is the "
                            "starting model throughout (TR-DPO's reference syncing is not "
                            "built): remove it"))
    for key in ("ref_model_mixup_alpha", "ref_model_sync_steps"):
        if t.has(key):
            out.skip(f"trl.{key}", t.raw[key], "read with sync_ref_model only")
    if sync is False:
        out.skip("trl.sync_ref_model", False, "off, nothing to map")
    aggregation = t.value("multi_objective_aggregation")
    if aggregation not in (None, "sum_then_normalize"):
        out.problem(refusal("trl.multi_objective_aggregation", aggregation,
                            "sum_then_normalize (or unset)", "; normalising each reward "
                            "before the sum (GDPO) is not built in ndjax"))
    elif aggregation is not None:
        out.skip("trl.multi_objective_aggregation", aggregation, "ndjax sums the weighted "
                 "rewards, then normalises (TRL's default)")
    for key, what in (("rollout_func", "custom rollouts (multi-turn, tools) are not built; "
                                       "ndjax samples one completion a row"),
                      ("reward_processing_classes", "they are reward models' tokenizers, and "
                                                    "ndjax scores with Python functions only")):
        if t.value(key):
            out.problem(refusal(f"trl.{key}", t.raw[key], "unset", f"; {what}: remove it"))
    if t.flag("async_prefetch", None):
        out.problem(refusal("trl.async_prefetch", True, "false", "; its completions come from "
                            "the previous step's weights, and ndjax samples each step's with "
                            "the weights it trains: remove it"))
    for key, off in (("replay_buffer_size", 0), ("reroll_start_fraction", 1.0)):
        value = t.value(key)
        if value not in (None, off):
            out.problem(refusal(f"trl.{key}", value, f"{off:g} (off)", "; ndjax trains on "
                                "each step's own rollouts (no replay or re-rolling): remove it"))
        elif value is not None:
            out.skip(f"trl.{key}", value, "off, nothing to map")
    for key in ("replay_recompute_logps", "reroll_max_groups", "skip_zero_advantage_batches"):
        if t.has(key):
            out.skip(f"trl.{key}", t.raw[key], "read by Axolotl's data producer's replay, "
                     "re-rolling and skipping, which ndjax does not do")
    bias = t.flag("use_bias_correction_kl", None)
    if bias is False and beta:
        out.problem(refusal("trl.use_bias_correction_kl", False, "true (or unset)", "; "
                            "ndjax's KL term is TRL's bias-corrected one (the k3 term times "
                            "the ratio): remove it"))
    elif bias is not None:
        out.skip("trl.use_bias_correction_kl", bias, "TRL's default true, as ndjax's KL term"
                 if bias else "grpo.beta is 0: no KL term")
    threshold = t.number("off_policy_mask_threshold", None)
    if threshold is not None and out.overrides.get("grpo.num_iterations", 1) > 1:
        out.problem(refusal("trl.off_policy_mask_threshold", t.raw["off_policy_mask_threshold"],
                            "unset", "; off-policy sequence masking is not built in ndjax: "
                            "remove it"))
    elif threshold is not None:
        out.skip("trl.off_policy_mask_threshold", t.raw["off_policy_mask_threshold"],
                 "masks nothing here: each step trains on the rollouts its own weights "
                 "sampled (no off-policy drift)")


def _generation_batch(t: Fields, out: Out, batch: Any) -> None:
    """generation_batch_size: TRL's default is the step's batch (one generation a step),
    which is ndjax's; another size spreads one generation over several steps."""
    size = t.integer("generation_batch_size", None, minimum=1)
    if size is None:
        return
    if size == batch:
        out.skip("trl.generation_batch_size", size, "the batch (TRL's default): one "
                 "generation a step, as ndjax samples")
    else:
        out.problem(refusal("trl.generation_batch_size", size, f"unset or the batch, {batch} "
                            "completions", "; ndjax samples each step's completions in that "
                            "step: remove it"))
