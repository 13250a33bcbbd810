"""Axolotl's adapter fields -> model.lora (ndjax.models.lora): ``adapter: lora`` with
``lora_r``, ``lora_alpha``, ``lora_target_modules`` / ``lora_target_linear`` and
``peft_use_rslora``, by their PEFT meaning; ``lora_model_dir`` (trained adapters to go on
from) as model.lora.init_from; ``adapter: qlora`` (``load_in_4bit``) and ``load_in_8bit``
as the quantized base of model.lora.quantize."""

from __future__ import annotations

from ndjax.axolotl.fields import Fields, Out, refusal

# What PEFT adapts when target_modules is unset, for every family ndjax reads
# (peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING: llama,
# mistral, qwen2, qwen3, gemma3 and the mixtures of experts all map to these).
PEFT_DEFAULT_TARGETS = "q_proj,v_proj"
# PEFT's LoraConfig defaults, which Axolotl passes on when a field is unset.
PEFT_DEFAULT_RANK, PEFT_DEFAULT_ALPHA = 8, 8


def lora(f: Fields, out: Out) -> bool:
    """Maps the adapter fields; returns whether the run trains adapters. A refused
    adapter kind is reported and the other fields are read as LoRA's, so that their
    problems are reported with it."""
    kind = f.value("adapter")
    if kind is None:
        return False
    if kind not in ("lora", "qlora"):
        out.problem(refusal("adapter", kind, "lora or qlora", "; ndjax trains LoRA adapters "
                            "(or, without adapter:, every weight)"))
    _quantization(f, out, kind)
    rank = f.integer("lora_r", PEFT_DEFAULT_RANK, minimum=1)
    out.set("model.lora.rank", rank, f.note("lora_r", f"PEFT's default {PEFT_DEFAULT_RANK}"))
    alpha = f.number("lora_alpha", float(PEFT_DEFAULT_ALPHA), minimum=0.0)
    if alpha <= 0:
        out.problem(refusal("lora_alpha", alpha, "a number > 0", "; PEFT scales the update by "
                            "lora_alpha / lora_r"))
    out.set("model.lora.alpha", alpha, f.note("lora_alpha", f"PEFT's default "
                                                            f"{PEFT_DEFAULT_ALPHA}"))
    targets, note = _targets(f, out)
    out.set("model.lora.target_modules", targets, note)
    if f.flag("peft_use_rslora", False):
        out.set("model.lora.use_rslora", True, "peft_use_rslora")
    # Axolotl loads lora_model_dir's adapters (PeftModel.from_pretrained) to go on from them.
    trained = f.text("lora_model_dir", None)
    if trained is not None:
        out.set("model.lora.init_from", trained, "lora_model_dir")
    dropout = f.number("lora_dropout", 0.0, maximum=1.0)
    if dropout:
        out.set("model.lora.dropout", dropout, "lora_dropout")
    _modules_to_save(f, out)
    return True


def _modules_to_save(f: Fields, out: Out) -> None:
    """lora_modules_to_save (PEFT's modules_to_save) -> model.lora.modules_to_save, for
    the modules ndjax trains beside the adapters (the embedding and the LM head)."""
    listed = f.value("lora_modules_to_save")
    if listed is None:
        return
    from ndjax.models.lora import SAVABLE  # jax: imported only where the field is set
    listed = [listed] if isinstance(listed, str) else listed
    if not isinstance(listed, list) or not all(isinstance(m, str) and m for m in listed):
        out.problem(refusal("lora_modules_to_save", listed, "a list of module names",
                            "; e.g. [embed_tokens, lm_head]"))
        return
    taken = [m for m in listed if m in SAVABLE]
    if taken:
        out.set("model.lora.modules_to_save", ",".join(dict.fromkeys(taken)),
                "lora_modules_to_save")
    if len(taken) < len(listed):
        out.skip("lora_modules_to_save", listed, f"ndjax trains {' and '.join(SAVABLE)} "
                 "beside the adapters, no other module"
                 + (f" ({', '.join(taken)} mapped)" if taken else ""))


def _targets(f: Fields, out: Out) -> tuple[str, str]:
    """model.lora.target_modules and its note: every projection under lora_target_linear
    (Axolotl adds the listed modules to it), else the listed ones, else PEFT's default for
    the family. ndjax's own check names a module it cannot adapt."""
    linear = f.flag("lora_target_linear", False)
    listed = f.value("lora_target_modules")
    if isinstance(listed, str):
        listed = [listed]  # PEFT reads one string as a regular expression: refused below
    if listed is not None and (not isinstance(listed, list)
                               or not all(isinstance(m, str) and m for m in listed)):
        out.problem(refusal("lora_target_modules", listed, "a list of module names",
                            "; e.g. [q_proj, k_proj, v_proj, o_proj]"))
        listed = None
    if linear:
        return "all-linear", "lora_target_linear" + (
            " (lora_target_modules adds nothing to every projection)" if listed else "")
    if listed:
        for name in listed:
            if not name.replace("_", "").isalnum():
                out.problem(refusal("lora_target_modules", name, "a module name such as "
                                    "q_proj (ndjax reads no regular expressions)",
                                    "; list the names"))
        return ",".join(listed), "lora_target_modules"
    return PEFT_DEFAULT_TARGETS, "lora_target_modules unset: PEFT's default for the family"


def _quantization(f: Fields, out: Out, kind: str) -> None:
    """model.lora.quantize: NF4 for ``adapter: qlora`` or ``load_in_4bit`` (bitsandbytes'
    NF4 with Axolotl's default 4-bit type), int8 for ``load_in_8bit``."""
    four, eight = f.flag("load_in_4bit", False), f.flag("load_in_8bit", False)
    if four and eight:
        out.problem(refusal("load_in_8bit", True, "false when load_in_4bit is true",
                            "; the base is quantized one way"))
    if kind == "qlora" or four:
        out.set("model.lora.quantize", "nf4", ", ".join(
            [*(["adapter: qlora"] if kind == "qlora" else []), *(["load_in_4bit"] if four
                                                                 else [])]))
    elif eight:
        out.set("model.lora.quantize", "int8", "load_in_8bit (ndjax's int8 scales each 64 "
                "values by their absmax; bitsandbytes' LLM.int8 splits outliers instead)")
