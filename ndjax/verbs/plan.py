r"""Rank every mesh for N GPUs by compiled memory and communication, before renting them.

    ndjax plan --config=configs/llama_fsdp.py --devices=64 \
        [--config.model.preset=llama3_8b ...] [--hardware=h100] [--top=5] [--json]

Reading the table: docs/compile-and-plan.md ("Choosing a layout").
"""

# Every factorisation of --devices into replica x fsdp x context x tensor, under
# each rule preset, is checked as train.py would check it (a failing layout is
# listed as rejected, with the reason), compiled ahead of time on simulated CPU
# devices in the target's dtypes, and priced with a roofline of the hardware
# (``ndjax/hardware/roofline.py``). See ``ndjax/planning/planner.py`` for the method.
# Progress goes to stderr; with --json stdout holds only the JSON list of every layout.

from __future__ import annotations

import json
import os
import sys

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
from ndjax.runtime.console import import_jax_quietly

import_jax_quietly()

PROGRAM = "ndjax plan"


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
        f.DEFINE_integer("devices", None, "GPUs to plan for."),
        f.DEFINE_integer("devices_per_node", 8, "GPUs per node (NVLink domain)."),
        f.DEFINE_string("hardware", "h100", "a100 | h100 | h200 | b200."),
        f.DEFINE_integer("top", 5, "Fitting layouts to print (all with --json)."),
        f.DEFINE_bool("json", False, "Print only a JSON list of every layout on stdout."),
        f.DEFINE_list("rules", None, "Rule presets to try; default: all (or the config's "
                      "own table)."),
        f.DEFINE_float("mem_fraction", None, "Share of GPU memory a step may use; default: "
                       "XLA_PYTHON_CLIENT_MEM_FRACTION, else 0.75 (jax's)."),
        f.DEFINE_integer("workers", None, "Compiling processes; default min(cores, 4); 0: "
                         "this one."),
        f.DEFINE_bool("exhaustive", False, "Compile every remedy of every layout, also "
                      "those that cannot rank in --top (slower)."),
        f.DEFINE_enum("compiler", "auto", ["auto", "gpu", "cpu"], "What measures each "
                      "layout. gpu: XLA's GPU compiler (the gpu-compile extra); cpu: "
                      "simulated CPU devices; auto: gpu where installed."),
        f.DEFINE_string("cache_dir", None, "Where measurements are kept; default "
                        "~/.cache/ndjax/plan; '' for none."),
        f.DEFINE_string("stages", "off", "Pipeline stages (mesh.stage) to plan: off; auto "
                        "(each count that divides the layers and gives every stage whole "
                        "nodes); or counts, e.g. 2,4. More than doubles the layouts."),
    ]
    flags.mark_flag_as_required("config")
    flags.mark_flag_as_required("devices")
    return holders


def _check_flags(hardware_names: list[str], presets: list[str]) -> None:
    from ndjax.runtime.errors import ConfigError

    args = flags.FLAGS  # the parsed command line
    n, per_node = args.devices, args.devices_per_node
    if n < 1:
        raise ConfigError(f"--devices={n} must be >= 1.")
    if per_node < 1:
        raise ConfigError(f"--devices_per_node={per_node} must be >= 1.")
    if args.hardware not in hardware_names:
        raise ConfigError(f"--hardware={args.hardware!r}: choose one of {hardware_names}.")
    if args.top < 1:
        raise ConfigError(f"--top={args.top} must be >= 1.")
    fraction = args.mem_fraction
    if fraction is not None and not 0 < fraction <= 1:
        raise ConfigError(f"--mem_fraction={fraction} must be in (0, 1].")
    if args.workers is not None and args.workers < 0:
        raise ConfigError(f"--workers={args.workers} must be >= 0.")
    stage_counts(args.stages)
    unknown = [r for r in args.rules or [] if r not in presets]
    if unknown:
        raise ConfigError(f"--rules: {unknown} are not rule presets; choose from {presets}.")


def stage_counts(text: str) -> list[int] | None:
    """--stages as ``planner.layouts`` takes it: [] (off), None (auto) or the counts."""
    from ndjax.runtime.errors import ConfigError

    if text in ("off", "auto"):
        return [] if text == "off" else None
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 2:
        raise ConfigError(f"--stages={text!r}: use off, auto or stage counts >= 2 (e.g. 2,4).")
    return counts


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f}"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in
                      enumerate(zip(r, widths))).rstrip() for r in rows]


def report(plan, config, top: int) -> str:  # noqa: ANN001 -- planner.Plan, ConfigDict
    """The ranked table, then what does not fit, what failed and what was rejected."""
    from ndjax.planning.planner import CONFIG_RULES

    hw, t = plan.hardware, config.train
    model = config.model.preset if not config.model.init_from else config.model.init_from
    dims = plan.model
    ranked, over = plan.by_status("ranked"), plan.by_status("over")
    failed, rejected = plan.by_status("failed"), plan.by_status("rejected")
    slower = plan.by_status("slower")
    lines = [
        f"plan: {model} ({dims.n_layers} layers, dim {dims.dim}) on {plan.devices} x {hw.name} "
        f"({plan.devices_per_node} per node); batch {t.batch_size} x {t.seq_len} tokens; "
        f"compute {np.dtype(dims.dtype).name}; "
        f"memory budget {_gib(plan.budget)} GiB per device",
        f"layouts: {len(plan.candidates) + plan.aliases} checked: {len(rejected)} rejected, "
        f"{plan.aliases} the same program as another, {len(ranked)} fit, {len(over)} do not, "
        f"{len(failed)} failed to compile"
        + (f", {len(slower)} not compiled (slower than #{top} at best)" if slower else ""),
        "step time: roofline, compute + communication with no overlap (overlapped in "
        "brackets); see ndjax/hardware/roofline.py",
        "memory: " + (f"XLA's GPU compiler for {hw.name} (no cuBLAS/cuDNN workspaces)"
                      if plan.measured_by != "cpu" else
                      "XLA's CPU compiler on simulated devices, a stand-in (it widens bf16 "
                      "buffers: figures run high; the gpu-compile extra gives the GPU's own)"),
        "",
    ]
    head = ["#", "layout", "rules", "remat", "accum", "GiB/device", "NVLink GB", "network GB",
            "compute ms", "comm ms", "step ms", "tokens/s", "MFU", "attention"]
    rows = [head]
    notes = []
    for i, c in enumerate(ranked[:top], start=1):
        e, link = c.estimate, c.link
        rules = c.layout.rules if c.layout.rules != CONFIG_RULES else "config's"
        rows.append([str(i), c.layout.mesh, rules, c.layout.remat, str(c.layout.grad_accum),
                     _gib(c.memory), _gb(link.inside_bytes), _gb(link.across_bytes),
                     _ms(e.compute_s), _ms(e.communication_s),
                     f"{_ms(e.serial_s)} ({_ms(e.overlapped_s)})", f"{e.tokens_per_s():,.0f}",
                     f"{e.mfu():.0%}", c.attention])
        if c.reason:
            notes.append(f"  #{i}: {c.reason} (tried: {'; '.join(c.tried)})")
        if c.aliases:
            notes.append(f"  #{i}: the same program as {', '.join(c.aliases)}")
        if schedule := c.layout.schedule:
            chunks = f" of {schedule.virtual} chunks" if schedule.virtual > 1 else ""
            notes.append(f"  #{i}: {type(schedule).__name__} over {schedule.stages} stages"
                         f"{chunks}, {schedule.microbatches} micro-batches: "
                         f"{schedule.bubble:.0%} of each stage's ticks idle (the bubble, in "
                         "compute ms)")
        if c.host:
            notes.append(f"  #{i}: {_gib(c.host)} GiB of layer inputs per device in host memory; "
                         f"{_ms(e.host_s)} ms over PCIe per step (in comm ms)")
        for finding in c.rematerializations:
            notes.append(f"  #{i}: the partitioner could not reshard efficiently: {finding}")
    if ranked:
        lines += _table(rows) + notes
        if len(ranked) > top:
            lines.append(f"  ... {len(ranked) - top} more fit (--top={len(ranked)} or --json)")
    else:
        lines.append("no layout fits; see below")
    if over:
        lines += ["", f"do not fit ({len(over)}):"]
        lines += [f"  {c.layout.mesh} [{c.layout.settings}, remat {c.layout.remat}]: "
                  f"{_gib(c.memory)} GiB; {c.reason}" for c in over]
    if slower:
        lines += ["", f"not compiled, could not rank ({len(slower)}):"]
        lines += [f"  {c.layout.mesh} [{c.layout.settings}, remat {c.layout.remat}]: {c.reason}"
                  for c in slower]
    if failed:
        lines += ["", f"failed to compile ({len(failed)}):"]
        lines += [f"  {c.layout.mesh} [{c.layout.settings}]: {c.reason}" for c in failed]
    if rejected:
        lines += ["", f"rejected ({len(rejected)}):"]
        lines += [f"  {c.layout.mesh} [{c.layout.settings}]: {c.reason}" for c in rejected]
    return "\n".join(lines)


def run(argv: list[str]) -> None:
    """The program, on the parsed flags."""
    args = flags.FLAGS  # the parsed command line
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from ndjax.runtime.console import quiet_libraries
    quiet_libraries(PROGRAM)
    config = loaded_config(PROGRAM, args["config"])

    import jax

    from ndjax.config import check_keys
    from ndjax.hardware import roofline
    from ndjax.parallel.rules import PRESETS
    from ndjax.planning import planner
    from ndjax.runtime import children
    from ndjax.runtime.errors import ConfigError

    def progress(message: str) -> None:
        print(f"{PROGRAM}: {message}", file=sys.stderr, flush=True)

    try:
        _check_flags(sorted(roofline.HARDWARE), sorted(PRESETS))
        check_keys(config)
    except ConfigError as e:
        fail(PROGRAM, e)
    n = args.devices
    # Simulated CPU devices, before any backend exists, even on a GPU host; GPUs, if
    # any, are the CUDA plugin's compile-only devices.
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)
    from ndjax.hardware import gpu_target
    from ndjax.runtime.console import native_stderr

    target = None
    if args.compiler == "gpu" or (args.compiler == "auto" and not gpu_target.missing()):
        target = args.hardware
        try:
            with native_stderr():
                devices = gpu_target.devices(roofline.HARDWARE[target], n, args.devices_per_node)
        except ConfigError as e:
            fail(PROGRAM, e)
    else:
        devices = jax.devices()[:n]
    workers = args.workers if args.workers is not None else min(os.cpu_count() or 1, 4)
    if workers:
        # Not with workers=0: a handler waits for the compile in this process to return,
        # where the default action ends it at once.
        children.stop_children_on_signals()
    cache_dir = planner.default_cache_dir() if args.cache_dir is None else args.cache_dir
    compiler = planner.Compiler(n, workers, planner.Cache(cache_dir or None), progress,
                                target, args.devices_per_node)
    fraction = args.mem_fraction or planner.mem_fraction_default()
    try:
        plan = planner.make_plan(config, n, roofline.HARDWARE[args.hardware],
                                 args.devices_per_node, fraction, compiler, devices,
                                 args.rules, progress, None if args.exhaustive else args.top,
                                 stage_counts(args.stages))
    except ConfigError as e:  # a field no layout changes (model dims, data, ...)
        fail(PROGRAM, e)
    finally:
        compiler.close()
    if args.json:
        print(json.dumps([c.as_dict() for c in plan.candidates], indent=1))
    else:
        print(report(plan, config, args.top))


def main() -> None:
    """``ndjax plan``."""
    show_in_help(define_flags())
    app.run(run, flags_parser=config_flags_parser(PROGRAM))


if __name__ == "__main__":
    main()
