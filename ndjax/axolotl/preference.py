"""Axolotl's preference training (``rl: dpo | ipo | orpo | simpo | kto``) as ndjax's
train.objective and preference section, by their TRL meaning: Axolotl hands them to
TRL's DPOTrainer (dpo, ipo), ORPOTrainer (orpo), CPOTrainer with loss_type simpo
(simpo) and KTOTrainer (kto); ``rl: grpo`` is read in ``grpo``. The datasets of a
preference run are read in ``datasets`` (their ``type:``s are Axolotl's preference
strategies, not its SFT ones)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ndjax.axolotl import grpo
from ndjax.axolotl.fields import Fields, Out, reason, refusal, show

# Axolotl's rl values ndjax trains, as train.objective.
OBJECTIVES = ("dpo", "ipo", "orpo", "simpo", "kto", "grpo")
# The others Axolotl has, refused with what is missing.
NOT_YET = {
    "gdpo": "GDPO (GRPO with each reward normalised before the sum) is not supported "
            "(rl: grpo is)",
    "ebft": "EBFT (energy-based fine-tuning, with generation) is not supported",
}
# What TRL calls beta, per objective (ndjax's preference.beta).
BETA = {"dpo": "DPO's beta", "ipo": "IPO's tau", "orpo": "ORPO's lambda",
        "simpo": "SimPO's beta", "kto": "KTO's beta"}
TRL_BETA = 0.1  # DPOConfig's, ORPOConfig's, CPOConfig's and KTOConfig's default
# The objectives with a reference model (preference.reference).
REFERENCED = ("dpo", "ipo", "kto")


@dataclasses.dataclass(frozen=True)
class Preference:
    """What ``rl`` asks for: ``objective`` (None: SFT), and whether it was refused (its
    datasets are then not read: they are of a kind ndjax does not train)."""

    objective: str | None = None
    refused: bool = False

    @property
    def rl(self) -> bool:
        return self.objective is not None or self.refused


def objective(f: Fields, out: Out) -> Preference:
    """train.objective and the preference section from ``rl`` and the fields Axolotl
    passes to TRL with it; SFT (``Preference()``) without ``rl``."""
    rl = f.value("rl")
    if rl in (None, False):
        return Preference()
    if rl not in OBJECTIVES:
        if isinstance(rl, str) and rl in NOT_YET:
            out.problem(f"rl: {show(rl)}: {NOT_YET[rl]}; ndjax's post-training objectives are "
                        f"{', '.join(OBJECTIVES)}.")
        else:
            out.problem(refusal("rl", rl, f"one of {', '.join(OBJECTIVES)}",
                                " (Axolotl's post-training methods ndjax trains); remove rl: "
                                "for supervised fine-tuning"))
        return Preference(refused=True)
    name = _loss_type(f, out, rl)
    out.set("train.objective", name, "rl" if name == rl else f"rl: {rl} with dpo_loss_type")
    if name == "grpo":
        grpo.settings(f, out)
    else:
        _beta(f, out, name)
    _smoothing(f, out, name)
    _simpo(f, out, name)
    _kto(f, out, name)
    _dpo_options(f, out, name)
    if name in REFERENCED:
        _reference(f, out, name)
    elif name != "grpo":  # grpo's reference is grpo.settings'
        for key in ("rl_adapter_ref_model", "precompute_ref_log_probs"):
            if f.value(key):
                out.skip(key, f.raw[key], f"rl: {name} uses no reference model")
    if name != "grpo":
        _trl(f, out)
    if f.has("max_prompt_len"):
        out.skip("max_prompt_len", f.value("max_prompt_len"), "TRL 1.16's GRPOConfig has no "
                 "max_prompt_length (Axolotl blocks it); ndjax leaves out prompts longer than "
                 "train.seq_len - grpo.max_completion_length" if name == "grpo" else
                 "ndjax never cuts a prompt; a pair longer than train.seq_len is dropped or "
                 "its completions' ends cut (excess_length_strategy), as TRL 1.16's "
                 "max_length does")
    return Preference(name)


def _loss_type(f: Fields, out: Out, rl: str) -> str:
    """dpo_loss_type (a list of TRL's DPO loss types; Axolotl passes it to DPOConfig):
    ['sigmoid'] is DPO, ['ipo'] IPO; TRL's other losses and their mixtures are not
    ndjax's. Only rl: dpo and ipo read it."""
    value = f.value("dpo_loss_type")
    if value is None:
        return rl
    if rl not in ("dpo", "ipo"):
        out.skip("dpo_loss_type", value, f"Axolotl reads it only with rl: dpo or ipo, not "
                 f"{rl}")
        return rl
    names = [value] if isinstance(value, str) else value
    implied = {("sigmoid",): "dpo", ("ipo",): "ipo"}.get(
        tuple(names) if isinstance(names, list) else None)
    if implied is None:
        out.problem(refusal("dpo_loss_type", value, "['sigmoid'] (DPO) or ['ipo'] (IPO)",
                            "; ndjax's preference objectives are TRL's sigmoid DPO, IPO, "
                            "ORPO and SimPO (rl: orpo, rl: simpo), and TRL's other DPO losses "
                            "and their mixtures are not built: remove dpo_loss_type or use one "
                            "of those"))
        return rl
    if rl == "ipo" and implied != "ipo":
        out.problem(f"rl: 'ipo' and dpo_loss_type: {show(value)} disagree (rl: ipo is "
                    "dpo_loss_type ['ipo']); keep one of them.")
        return rl
    return implied


def _beta(f: Fields, out: Out, name: str) -> None:
    """preference.beta: trl.beta, else rl_beta, else orpo_alpha (Axolotl hands ORPO's
    lambda to TRL as beta), else TRL's 0.1."""
    raw = f.raw.get("trl")
    nested = raw.get("beta") if isinstance(raw, Mapping) else None
    sources = (("trl.beta", nested), ("rl_beta", f.value("rl_beta")),
               ("orpo_alpha", f.value("orpo_alpha")))
    used = None
    for key, value in sources:
        if value is None:
            continue
        if used is not None:
            out.skip(key, value, f"{used} is set, and Axolotl reads it first")
            continue
        number = _positive(out, key, value)
        used = key
        out.set("preference.beta", TRL_BETA if number is None else number,
                f"{key} ({BETA[name]})")
    if used is None:
        out.set("preference.beta", TRL_BETA, f"trl.beta, rl_beta and orpo_alpha unset: TRL's "
                f"default ({BETA[name]})")


def _positive(out: Out, key: str, value: Any) -> float | None:
    number = value
    if isinstance(value, str):  # YAML reads 5e-2 as a string
        try:
            number = float(value)
        except ValueError:
            number = None
    if isinstance(number, bool) or not isinstance(number, int | float) or not number > 0 \
            or number == float("inf"):
        out.problem(refusal(key, value, "a number > 0", f"; e.g. {key}: 0.1"))
        return None
    return float(number)


def _smoothing(f: Fields, out: Out, name: str) -> None:
    """dpo_label_smoothing: DPO's (conservative DPO, cDPO); Axolotl passes it to the DPO
    trainer, whose IPO loss has no smoothing."""
    value = f.number("dpo_label_smoothing", None, below=0.5)
    if value is None:
        return
    if name == "dpo":
        out.set("preference.label_smoothing", value, "dpo_label_smoothing" + (
            " (ndjax applies conservative DPO's loss, cDPO; TRL >= 0.29's sigmoid DPO "
            "ignores it, so this run differs from Axolotl's there)" if value else ""))
    elif value:
        out.skip("dpo_label_smoothing", value, "TRL's IPO loss has no label smoothing"
                 if name == "ipo" else f"Axolotl passes it to rl: dpo only, not {name}")


def _simpo(f: Fields, out: Out, name: str) -> None:
    """simpo_gamma and cpo_alpha, SimPO's (TRL's CPOConfig with loss_type simpo)."""
    gamma, alpha = f.number("simpo_gamma", None), f.number("cpo_alpha", None)
    if name == "simpo":
        out.set("preference.simpo_gamma", 0.5 if gamma is None else gamma,
                f.note("simpo_gamma", "TRL's default 0.5"))
        out.set("preference.cpo_alpha", 1.0 if alpha is None else alpha,
                f.note("cpo_alpha", "TRL's default 1.0: the chosen completions' "
                       "cross-entropy added, as CPOTrainer does"))
        return
    for key, value in (("simpo_gamma", gamma), ("cpo_alpha", alpha)):
        if value is not None:
            out.skip(key, value, f"Axolotl reads it only with rl: simpo, not {name}")


def _kto(f: Fields, out: Out, name: str) -> None:
    """kto_desirable_weight, kto_undesirable_weight: KTOConfig's desirable_weight and
    undesirable_weight, which Axolotl sets to the value or 1.0 (an unset or 0 one is 1)."""
    for side in ("desirable", "undesirable"):
        key = f"kto_{side}_weight"
        value = f.number(key, None)
        if name != "kto":
            if value is not None:
                out.skip(key, value, f"Axolotl reads it only with rl: kto, not {name}")
            continue
        note = (key if value else f"{key} {'0' if value == 0 else 'unset'}: Axolotl's "
                "`or 1.0`, TRL's default") + f": the {side} examples' loss weight"
        out.set(f"preference.{side}_weight", value or 1.0, note)
    if name == "kto" and f.value("precompute_ref_log_probs"):
        out.skip("precompute_ref_log_probs", True, "Axolotl passes it to rl: dpo and ipo "
                 "only; ndjax computes the reference's log-probabilities in each step")


def _dpo_options(f: Fields, out: Out, name: str) -> None:
    """The DPO trainer's other options: those that change the loss are refused, the
    others (kernels, padding, precomputing) change no result and are listed."""
    dpo = name in ("dpo", "ipo")
    weights = f.value("dpo_loss_weights")
    if weights is not None:
        ones = weights in (1, 1.0, [1], [1.0])
        if not dpo:
            out.skip("dpo_loss_weights", weights, f"Axolotl reads it only with rl: dpo or "
                     f"ipo, not {name}")
        elif not ones:
            out.problem(refusal("dpo_loss_weights", weights, "[1.0] (the one loss, "
                                "unweighted)", "; ndjax weighs no losses: remove it"))
    if f.value("dpo_use_weighting"):
        if dpo:
            out.problem(refusal("dpo_use_weighting", True, "false", "; ndjax has no WPO "
                                "weighting of the pairs: remove it"))
        else:
            out.skip("dpo_use_weighting", True, f"Axolotl reads it only with rl: dpo or "
                     f"ipo, not {name}")
    rpo = f.value("rpo_alpha")
    if rpo is not None:
        if dpo:
            out.problem(refusal("rpo_alpha", rpo, "unset", "; ndjax's DPO has no RPO term "
                                "(the chosen completions' NLL): remove it"))
        else:
            out.skip("rpo_alpha", rpo, f"Axolotl reads it only with rl: dpo, not {name}")
    if f.value("dpo_padding_free"):
        out.skip("dpo_padding_free", True, "changes no loss: ndjax's rows hold one pair each "
                 "(Axolotl does not pack preference pairs), the padding masked out")
    if f.value("dpo_use_liger_kernel"):
        out.skip("dpo_use_liger_kernel", True, "a kernel: ndjax computes the same loss on "
                 "the log-probabilities of its own chunked LM head")
    if dpo and f.value("precompute_ref_log_probs"):
        out.skip("precompute_ref_log_probs", True, "ndjax computes the reference's "
                 "log-probabilities in each step instead (the same values), from the "
                 "reference it holds (preference.reference)")


def _reference(f: Fields, out: Out, name: str) -> None:
    """preference.reference=auto (dpo, ipo, kto), with what it is here: the base with the
    adapters off under fresh LoRA adapters, the trained ones of lora_model_dir (TRL's
    reference under a PeftModel), a frozen copy of base_model's weights without LoRA
    (Axolotl loads a second model)."""
    adapters = f.raw.get("adapter") in ("lora", "qlora")
    separate = f.value("rl_adapter_ref_model")
    if f.raw.get("lora_model_dir") and adapters:
        note = ("auto: lora_model_dir's trained adapters, which ndjax starts from and "
                "references (initial_adapters), as TRL does with a PeftModel; Axolotl's "
                f"{name} builds fresh adapters instead and does not load lora_model_dir")
    elif adapters:
        note = "auto: base_model with the adapters off, TRL's reference under LoRA"
        if f.raw.get("lora_modules_to_save"):
            note += " (lora_modules_to_save's modules as they start: initial_adapters)"
    else:
        note = "auto: a frozen copy of base_model's weights, as Axolotl loads a reference model"
    if separate and adapters:
        note += ("; rl_adapter_ref_model: Axolotl loads base_model again as the reference, "
                 "the same weights")
    elif separate:
        out.skip("rl_adapter_ref_model", separate, "no adapter: the reference is a copy of "
                 "base_model either way")
    out.set("preference.reference", "auto", note)


def _trl(f: Fields, out: Out) -> None:
    """The ``trl:`` mapping: its beta is read with rl_beta; the others are listed (Axolotl
    hands them to rl: grpo only)."""
    raw = f.value("trl")
    if raw is None:
        return
    if not isinstance(raw, Mapping):
        out.problem(refusal("trl", raw, "a mapping of TRL's settings", ", e.g. trl: {beta: "
                            "0.1}"))
        return
    for key, value in raw.items():
        if key == "beta" and value is not None:
            continue  # preference.beta's note names it
        if key == "max_completion_length":
            out.skip("trl.max_completion_length", value, "ndjax never cuts a completion "
                     "alone: a pair longer than train.seq_len is dropped or its completions' "
                     "ends cut (excess_length_strategy)")
        elif key in grpo.KNOWN and value not in (None, False, "", [], {}):
            out.skip(f"trl.{key}", value, "Axolotl passes it to rl: grpo only")
        else:
            out.skip(f"trl.{key}", value, reason(str(key), value))
