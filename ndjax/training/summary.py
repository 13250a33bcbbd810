"""What a run says before its first step and after its last: a few lines each."""

from __future__ import annotations

import os
import shlex
from typing import Any

import jax
import numpy as np

from ndjax.experiment import Experiment
from ndjax.models import decoder, lora
from ndjax.parallel import pipeline
from ndjax.training.report import format_bytes


def _size(n: float) -> str:
    for unit in ("", "K", "M", "B", "T"):
        if abs(n) < 1000 or unit == "T":
            return f"{n:.3g}{unit}"
        n /= 1000
    raise AssertionError


def startup(exp: Experiment, workdir: str, resume_step: int | None) -> list[str]:
    """Before compiling: where it runs, what it trains, on what, and where results go."""
    c, cfg, t = exp.settings, exp.model_cfg, exp.settings.train
    devices = exp.mesh.devices.flat
    kinds = sorted({d.device_kind for d in devices})
    rules = c.rules if isinstance(c.rules, str) else "custom table"
    tokenizer = c.data.tokenizer if c.data.source != "synthetic" else "-"
    micro = f", {t.grad_accum} micro-batches of {t.batch_size // t.grad_accum}" \
        if t.grad_accum > 1 else ""
    source = f" (dims from {c.model.init_from})" if c.model.init_from else ""
    return [
        f"devices: {exp.mesh.devices.size} x {', '.join(kinds)} in {jax.process_count()} "
        f"process(es); mesh {exp.dims}; rules {rules}",
        f"model: {cfg.family} "
        f"{'(resolved)' if c.model.resolved and not c.model.init_from else c.model.preset}"
        f"{source}, {_size(decoder.num_params(cfg))} parameters "
        f"({_size(decoder.num_params(cfg, embeddings=False))} without embeddings"
        + (f"; {_size(decoder.num_params(cfg, active=True))} active per token: "
           f"{cfg.experts_per_token} of {cfg.n_experts} experts, grouped matmuls "
           f"{cfg.moe_impl}" if cfg.n_experts else "")
        + ")" + _lora(cfg) + "; "
        f"compute {np.dtype(cfg.dtype).name}, parameters {np.dtype(cfg.param_dtype).name}, "
        f"moments {t.opt_state_dtype}; remat {cfg.remat}; layers "
        f"{'scanned' if cfg.scan_layers else 'unrolled'}",
        *_loss(exp),
        *_pipeline(exp),
        f"attention: {exp.attention.describe()}",
        f"batch: {t.batch_size} rows x {t.seq_len} tokens = {t.batch_size * t.seq_len} "
        f"tokens per step{micro}; {t.steps} steps; data {c.data.source}, tokenizer {tokenizer}",
        f"workdir: {workdir}; " + (f"resuming from checkpoint step {resume_step}"
                                   if resume_step is not None else "starting at step 1"),
    ]


def _pipeline(exp: Experiment) -> list[str]:
    """With stages: the schedule, what each stage holds and runs, and its bubble."""
    cfg = exp.model_cfg
    if cfg.stages == 1:
        return []
    plan = pipeline.schedule(cfg.stages, cfg.microbatches, cfg.virtual_stages,
                             cfg.pipeline_schedule)
    staged = decoder.stacks(cfg)[-1]
    chunk = staged.count // (plan.stages * plan.virtual)
    before = f" after {staged.first} dense layers on every stage" if staged.first else ""
    layers = f"{chunk} layer{'s' * (chunk > 1)}"
    holds = (f"{layers} each" if plan.virtual == 1 else
             f"{plan.virtual} chunks of {layers} each, taken in turn")
    head = (f"pipeline: {plan.name}, {plan.stages} stages of {holds}{before}; "
            f"{plan.microbatches} micro-batches per step"
            + (" per grad_accum slice" if exp.settings.train.grad_accum > 1 else ""))
    if isinstance(plan, pipeline.OneFOneB):
        return [f"{head}: {plan.ticks} ticks of a forward and a backward, the first and last "
                f"{plan.stages - 1} of one kind, {plan.bubble:.0%} of the step idle on each "
                f"stage (the bubble); a stage holds at most {plan.held} micro-batches' "
                "activations"]
    return [f"{head}: {plan.ticks} ticks, {plan.bubble:.0%} of them idle on each stage "
            "(the bubble)"]


def _loss(exp: Experiment) -> list[str]:
    """A mixture of experts' training loss, term by term: which of the router's losses
    are in it, and why each other one is logged only."""
    if not exp.model_cfg.n_experts:
        return []
    options, model = exp.step_options, exp.settings.model
    aux_off = "model.router_aux_loss_coef 0"
    if exp.checkpoint is not None and model.router_aux_loss_coef is None \
            and not exp.checkpoint.config.get("output_router_logits"):
        # transformers' rule for the checkpoint (hf_config.read_aux_loss), not an oversight.
        aux_off = ("model.init_from's config.json has output_router_logits false: "
                   "transformers trains it without; set model.router_aux_loss_coef to add it")
    terms, logged = ["cross-entropy"], []
    for coef, name, metric, off in (
            (options.aux_loss_coef, "load-balancing loss", "aux_loss", aux_off),
            (options.z_loss_coef, "router z-loss", "router_z_loss", "model.router_z_loss_coef 0")):
        if coef:
            terms.append(f"{coef:g} x {name} ({metric})")
        else:
            logged.append(f"{metric} ({off})")
    return ["loss: " + " + ".join(terms)
            + (f"; logged, not trained on: {', '.join(logged)}" if logged else "")]


def _lora(cfg) -> str:
    """What a LoRA run trains, as PEFT's ``print_trainable_parameters`` says it."""
    if cfg.lora is None:
        return ""
    n, base = lora.num_adapter_params(cfg), decoder.num_params(cfg)
    quant = f", base {cfg.lora.quant.kind}" if cfg.lora.quant else ""
    return (f"; LoRA rank {cfg.lora.rank} on {','.join(cfg.lora.targets)}: {_size(n)} "
            f"trainable ({100 * n / (n + base):.2f}%), dropout {cfg.lora.dropout:g}{quant}")


def compiled(exp: Experiment, seconds: float) -> str:
    """After compiling: the step's memory per device, as XLA planned it."""
    try:
        m = exp.compiled_step.memory_analysis()
    except Exception:  # noqa: BLE001 -- not every backend reports one
        m = None
    if m is None:
        return f"compiled the train step in {seconds:.1f} s"
    args, temp = m.argument_size_in_bytes, m.temp_size_in_bytes
    return (f"compiled the train step in {seconds:.1f} s; memory per device: "
            f"{format_bytes(args + temp)} ({format_bytes(args)} parameters, optimizer state "
            f"and batch + {format_bytes(temp)} temporaries)")


def end(logged: list[dict[str, Any]], wall_seconds: float, workdir: str,
        checkpoint: str | None, hf_dir: str | None) -> list[str]:
    """After the last step: how it went and where everything is."""
    steps = [r for r in logged if "loss" in r]
    evals = [r for r in logged if "eval_loss" in r]
    lines = []
    if steps:
        last = steps[-1]
        timed = steps[1:] or steps  # the first logged step includes warm-up
        seconds = sum(r["step_time"] for r in timed)
        tokens = sum(r["tokens_per_sec"] * r["step_time"] for r in timed)
        mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
        lines.append(
            f"done: step {last['step']}, train loss {last['loss']:.4f}"
            + (f", eval loss {evals[-1]['eval_loss']:.4f} (perplexity "
               f"{evals[-1]['eval_perplexity']:.2f})" if evals else "")
            + f"; {wall_seconds:.1f} s in all, {tokens / seconds:.0f} tokens/s"
            + (f", MFU {100 * float(np.mean(mfus)):.1f}%" if mfus else "")
            + " (mean of the logged steps after the first)")
    else:
        lines.append(f"done: no steps left to run; {wall_seconds:.1f} s in all")
    if checkpoint:
        lines.append(f"checkpoint: {checkpoint}")
    if hf_dir:
        lines.append(f"Hugging Face export: {hf_dir}")
    lines.append(f"metrics: {os.path.join(workdir, 'metrics.jsonl')}; plot them with: "
                 f"ndjax plot --workdir={shlex.quote(workdir)}")
    return lines
