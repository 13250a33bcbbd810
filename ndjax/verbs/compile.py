r"""Compile a step for N NVIDIA GPUs on a machine without them, and say what it needs.

    ndjax compile --config=configs/llama_fsdp_tp.py --hardware=h100 --devices=8 \
        [--config.train.seq_len=16384 ...] [--step=train|eval|decode] [--json]

Needs the gpu-compile extra; what it cannot see: docs/compile-and-plan.md.
"""

# The same step train.py runs (``Experiment.from_config`` with every check, then
# the jitted step with the GPU compiler options), lowered against abstract inputs
# and compiled by XLA's GPU compiler for the GPUs of ``--hardware`` (``ndjax/hardware/
# gpu_target.py``; needs ``pip install -e '.[gpu-compile]'``). Nothing is allocated
# or run. It prints the memory per device (arguments, temporaries, output, total,
# against the GPU's memory and the budget), the attention kernel and why, every
# collective, and the compile time. ``--json``: one object on stdout.
#
# What the compile cannot see: autotuning, cuBLAS/cuDNN workspaces, speed
# (docs/compile-and-plan.md, "Compiling for GPUs you don't have").

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np
from absl import app, flags
from ml_collections import config_flags

from ndjax.runtime.cli import (
    BAD_OVERRIDE,
    config_flags_parser,
    fail,
    innermost,
    loaded_config,
    show_in_help,
)
from ndjax.runtime.console import import_jax_quietly, native_stderr

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import_jax_quietly()
import jax  # noqa: E402

from ndjax.ops import grouped_matmul  # noqa: E402

PROGRAM = "ndjax compile"
STEPS = ("train", "eval", "decode")


def define_flags() -> list[flags.FlagHolder]:
    """The command line's flags (read as ``flags.FLAGS.name``), defined by ``main``, not
    on import: see ndjax/verbs/__init__.py."""
    try:
        config = config_flags.DEFINE_config_file(
            "config", None, "Experiment config file (configs/*.py), as for train.py.")
    except BAD_OVERRIDE as e:
        fail(PROGRAM, f"bad --config override: {innermost(e)}")
    f = flags
    holders = [
        config,
        f.DEFINE_string("hardware", "h100", "a100 | h100 | h200 | b200."),
        f.DEFINE_integer("devices", None, "GPUs to compile for (the mesh's product)."),
        f.DEFINE_integer("devices_per_node", 8, "GPUs per node (NVLink domain)."),
        f.DEFINE_string("step", "train", "train | eval | decode: which step to compile. "
                        "decode: generation's prefill and decode loop (python -m "
                        "ndjax generate) for train.batch_size prompts of train.seq_len - "
                        "--max_new_tokens tokens, with a KV cache of train.seq_len."),
        f.DEFINE_integer("max_new_tokens", 256, "--step=decode: tokens to generate."),
        f.DEFINE_bool("json", False, "Print one JSON object on stdout, nothing else."),
        f.DEFINE_string("dump_hlo", None, "Write the optimized HLO text to this directory."),
        f.DEFINE_float("mem_fraction", None, "Share of GPU memory a step may use; default: "
                       "XLA_PYTHON_CLIENT_MEM_FRACTION, else 0.75 (jax's)."),
    ]
    flags.mark_flag_as_required("config")
    flags.mark_flag_as_required("devices")
    return holders


def _check_flags() -> None:
    from ndjax.hardware import gpu_target
    from ndjax.runtime.errors import ConfigError

    args = flags.FLAGS  # the parsed command line
    gpu_target.hardware(args.hardware)
    if args.devices < 1:
        raise ConfigError(f"--devices={args.devices} must be >= 1.")
    if args.step not in STEPS:
        raise ConfigError(f"--step={args.step!r}: choose one of {STEPS}.")
    fraction = args.mem_fraction
    if fraction is not None and not 0 < fraction <= 1:
        raise ConfigError(f"--mem_fraction={fraction} must be in (0, 1].")
    if args.step == "decode" and args.max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens={args.max_new_tokens} must be >= 1.")
    if args.dump_hlo is not None and os.path.exists(args.dump_hlo) \
            and not os.path.isdir(args.dump_hlo):
        raise ConfigError(f"--dump_hlo={args.dump_hlo!r} exists and is not a directory.")


def _decode_programs(config: Any, devices: list, max_new_tokens: int) -> tuple[Any, dict]:
    """Generation's two programs, as ``ndjax generate`` builds them."""
    from ndjax.experiment import Experiment
    from ndjax.models.sampling import Generator
    from ndjax.runtime.errors import ConfigError
    from ndjax.verbs.generate import for_generation

    t = config.train
    if max_new_tokens >= t.seq_len:
        raise ConfigError(f"--max_new_tokens={max_new_tokens} leaves no room for a prompt in "
                          f"train.seq_len={t.seq_len} (the KV cache). Use fewer.")
    exp = Experiment.from_config(for_generation(config, len(devices)), devices)
    gen = Generator(exp.graphdef, exp.abstract_state.params, exp.model_cfg, exp.rules,
                    max_new_tokens=max_new_tokens, max_len=t.seq_len)
    with exp.for_target():
        prefill, loop = gen.compile_ahead(t.batch_size, t.seq_len - max_new_tokens)
    return exp, {"prefill": prefill, "decode": loop}


def compile_for(config: Any, hardware: str, n: int, per_node: int = 8,
                step: str = "train", max_new_tokens: int = 256) -> dict[str, Any]:
    """Compile ``step`` of ``config`` for ``n`` GPUs of kind ``hardware``; what it
    needs (the JSON fields of ``--json``) and, under ``hlo``, the optimized HLO (for
    ``decode``, of whichever of prefill and decode needs more memory)."""
    from ndjax.experiment import Experiment
    from ndjax.hardware import gpu_target
    from ndjax.planning.planner import collective_records

    hw = gpu_target.hardware(hardware)
    with native_stderr() as native:
        devices = gpu_target.devices(hw, n, per_node)
        start = time.perf_counter()
        if step == "decode":
            exp, programs = _decode_programs(config, devices, max_new_tokens)
        else:
            exp = Experiment.from_config(config, devices)
            programs = {step: exp.compiled_step if step == "train" else exp.compiled_eval}
        seconds = time.perf_counter() - start
    memory = {name: c.memory_analysis() for name, c in programs.items()}
    # The program that needs the most is what must fit (decode: prefill or the loop).
    name = max(memory, key=lambda k: memory[k].argument_size_in_bytes
               + memory[k].temp_size_in_bytes)
    compiled, m = programs[name], memory[name]
    hlo = compiled.as_text()
    # The decode loop stops when every row has ended: its collectives are counted once,
    # per generated token.
    found = collective_records(hlo, exp.mesh, devices,
                               unknown_trips=1 if step == "decode" else None)
    host = int(m.host_temp_size_in_bytes + m.host_argument_size_in_bytes)  # remat=offload
    return dict(hardware=hardware, gpu=hw.name, devices=n, devices_per_node=per_node,
                step=step, mesh={a: int(s) for a, s in exp.mesh.shape.items()},
                attention="kv-cache" if step == "decode" else exp.attention.label,
                attention_why=("the KV-cache attention of ndjax.models.decode"
                               if step == "decode" else exp.attention.describe()),
                programs={k: dict(argument_bytes=int(v.argument_size_in_bytes),
                                  temp_bytes=int(v.temp_size_in_bytes)) for k, v in memory.items()},
                experts=(grouped_matmul.DESCRIPTIONS[exp.model_cfg.moe_impl]
                         if exp.model_cfg.n_experts else None),
                dtype=np.dtype(exp.model_cfg.dtype).name,
                remat=exp.model_cfg.remat, scan_layers=exp.model_cfg.scan_layers,
                **_weight_bytes(exp),
                argument_bytes=int(m.argument_size_in_bytes), temp_bytes=int(m.temp_size_in_bytes),
                output_bytes=int(m.output_size_in_bytes), alias_bytes=int(m.alias_size_in_bytes),
                host_bytes=host, host_memory_bytes=int(hw.host_memory_bytes),
                pcie_gbs=hw.pcie_gbs, offload_s=hw.offload_s(host),
                gpu_memory_bytes=int(hw.memory_bytes), compile_s=round(seconds, 2),
                collectives=found, rematerializations=native.rematerializations,
                compiler_over_memory=native.over_memory, hlo=hlo)


def _weight_bytes(exp: Any) -> dict[str, Any]:
    """The parameters' bytes on each device (the largest shard), what trains and, under
    LoRA, the frozen base apart, and how that base is stored (``base_storage``: its
    dtype, or the QLoRA quantization)."""
    from ndjax.models import lora
    from ndjax.planning.planner import bytes_per_device

    train, frozen = lora.split(exp.abstract_state.params, exp.adapters_only, exp.saved_params)
    q = exp.model_cfg.lora.quant if exp.adapters_only else None
    return dict(trainable_param_bytes=bytes_per_device(train),
                frozen_param_bytes=bytes_per_device(frozen),
                base_storage=(f"{q.kind}, float32 scales per {q.block}" if q else
                              np.dtype(exp.model_cfg.param_dtype).name))


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def report(r: dict[str, Any], config: Any) -> str:
    t = config.train
    mesh = " x ".join(f"{a}={s}" for a, s in r["mesh"].items() if s > 1) or "1 device"
    lines = [
        f"compiled the {r['step']} step for {r['devices']} x {r['gpu']} ({r['devices_per_node']} "
        f"per node) in {r['compile_s']:.1f} s: {mesh}; batch {t.batch_size} x {t.seq_len}; "
        f"{r['dtype']} compute, remat {r['remat']}, layers "
        f"{'scanned' if r['scan_layers'] else 'unrolled'}",
        f"attention: {r['attention_why']}",
        *([f"experts: {r['experts']}"] if r.get("experts") else []),
        f"parameters per device: {_gib(r['trainable_param_bytes'])} trained"
        + (f", {_gib(r['frozen_param_bytes'])} frozen base ({r['base_storage']})"
           if r["frozen_param_bytes"] else f" ({r['base_storage']})"),
        f"memory per device: arguments {_gib(r['argument_bytes'])} + temporaries "
        f"{_gib(r['temp_bytes'])} = {_gib(r['memory_bytes'])} of {_gib(r['budget_bytes'])} "
        f"budget ({r['mem_fraction']:.0%} of {_gib(r['gpu_memory_bytes'])}): "
        + ("fits" if r["fits"] else "DOES NOT FIT")
        + f"; output {_gib(r['output_bytes'])} (aliased to arguments: {_gib(r['alias_bytes'])})",
        *([f"host memory per device (pinned; the offloaded layer inputs): "
           f"{_gib(r['host_bytes'])} of {_gib(r['host_budget_bytes'])} "
           f"({r['mem_fraction']:.0%} of the node's {_gib(r['host_memory_bytes'])} per GPU); "
           f"copied out and back each step: {r['offload_s']:.2f} s "
           f"over PCIe at {r['pcie_gbs']:.0f} GB/s each way"] if r["host_bytes"] else []),
        *(["programs: " + "; ".join(
            f"{k} {_gib(v['argument_bytes'])} + {_gib(v['temp_bytes'])}"
            for k, v in r["programs"].items())] if len(r["programs"]) > 1 else []),
        "not counted: cuBLAS/cuDNN workspaces (no autotuning without a GPU)",
        f"collectives per {'generated token' if r['step'] == 'decode' else 'step'} "
        f"({len(r['collectives'])} in the program; --json lists each):",
    ]
    kinds: dict[tuple[str, int], list[int]] = {}
    for c in r["collectives"]:
        row = kinds.setdefault((c["kind"], c["group_size"]), [0, 0])
        row[0] += c["executed"]
        row[1] += c["bytes"] * c["executed"]
    for (kind, group), (runs, size) in sorted(kinds.items()):
        lines.append(f"  {kind:<19} group {group:>3}: {runs:>5} x, {size / 2**30:>9,.2f} GiB "
                     "of results per device")
    for finding in r["rematerializations"]:
        lines.append(f"partitioner: {finding}")
    for finding in r["compiler_over_memory"]:
        lines.append(f"XLA's GPU compiler: {finding}")
    return "\n".join(lines)


def run(argv: list[str]) -> None:
    """The program, on the parsed flags."""
    args = flags.FLAGS  # the parsed command line
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = loaded_config(PROGRAM, args["config"])
    from ndjax.runtime.console import quiet_libraries
    quiet_libraries(PROGRAM)

    from ndjax.config import check_keys
    from ndjax.hardware import gpu_target
    from ndjax.planning.planner import mem_fraction_default
    from ndjax.runtime.errors import ConfigError

    # CPU devices only: the GPUs are compile-only devices of the CUDA plugin, and
    # this machine need not have (or may have other) GPUs.
    jax.config.update("jax_platforms", "cpu")
    try:
        with native_stderr():  # the CUDA plugin's start-up lines
            _check_flags()
            check_keys(config)
            gpu_target.require()
            jax.devices()
        result = compile_for(config, args.hardware, args.devices, args.devices_per_node,
                             args.step, args.max_new_tokens)
    except ConfigError as e:
        fail(PROGRAM, e)
    fraction = args.mem_fraction or mem_fraction_default()
    hlo = result.pop("hlo")
    total = result["argument_bytes"] + result["temp_bytes"]
    budget = result["gpu_memory_bytes"] * fraction
    result.update(memory_bytes=total, mem_fraction=fraction, budget_bytes=int(budget),
                  host_budget_bytes=int(result["host_memory_bytes"] * fraction),
                  fits=gpu_target.hardware(args.hardware).fits(total, result["host_bytes"],
                                                                 fraction))
    if args.dump_hlo:
        os.makedirs(args.dump_hlo, exist_ok=True)
        path = os.path.join(args.dump_hlo, f"{args.step}_step.{args.hardware}.hlo.txt")
        with open(path, "w") as f:
            f.write(hlo)
        result["hlo_file"] = path
    print(json.dumps(result, indent=1) if args.json else report(result, config))
    sys.stdout.flush()


def main() -> None:
    """``ndjax compile``."""
    show_in_help(define_flags())
    app.run(run, flags_parser=config_flags_parser(PROGRAM))


if __name__ == "__main__":
    main()
