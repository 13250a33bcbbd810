"""Pipeline schedules side by side, compiled for H100s: GPipe, the circular schedule and
1F1B, with FSDP inside the stages gathered at every tick or once a step, against no
stages; then the temporaries of GPipe and 1F1B as the micro-batches grow.

    PYTHONPATH=. python bench/pipeline_schedules.py          # 20 compiles (gpu-compile extra)
    PYTHONPATH=. python bench/pipeline_schedules.py --tiny   # smoke run: the tiny model

Llama 3 8B cut to 8 of its 32 layers (so each compile takes seconds), 16 rows of 4096
tokens a step, bfloat16 compute, float32 parameters and moments, on 8 H100s, compiled by
XLA's GPU compiler (no GPU needed, nothing run). Columns: the schedule's ticks and bubble,
memory per device as the compile plans it, every collective's bytes per device and step
by kind (results per device, executions counted: ``ndjax.parallel.collectives``), and
the roofline step time (``ndjax.hardware.roofline``: what the devices compute, bubble
and rematerialisation included (``planner.executed_flops``), at peak, then the bytes
over NVLink, not overlapped). Estimates from compiles, not runs.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform

GiB = 2**30
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute")
# (label, mesh, virtual_stages, pipeline_gather_once, remat, mesh.pipeline_schedule)
CASES = [
    ("none", dict(fsdp=8), 1, False, "full", "gpipe"),
    ("GPipe", dict(stage=4, fsdp=2), 1, False, "none", "gpipe"),
    ("GPipe, gathered once", dict(stage=4, fsdp=2), 1, True, "none", "gpipe"),
    ("GPipe", dict(stage=4, fsdp=2), 1, False, "full", "gpipe"),
    ("circular", dict(stage=4, fsdp=2), 2, False, "none", "gpipe"),
    ("circular, gathered once", dict(stage=4, fsdp=2), 2, True, "none", "gpipe"),
    ("1F1B", dict(stage=4, fsdp=2), 1, False, "none", "1f1b"),
    ("1F1B, gathered once", dict(stage=4, fsdp=2), 1, True, "none", "1f1b"),
    ("GPipe", dict(stage=4, tensor=2), 1, False, "none", "gpipe"),
    ("circular", dict(stage=4, tensor=2), 2, False, "none", "gpipe"),
    ("1F1B", dict(stage=4, tensor=2), 1, False, "none", "1f1b"),
]
TINY_CASES = [CASES[0], CASES[2], CASES[5], CASES[7]]
MICROBATCHES = 8
# Temporaries as the micro-batches grow, at 2 rows each (batch 2 M) on stage=4 x fsdp=2:
# (label, remat, mesh.pipeline_schedule).
GROWTH = [("GPipe", "none", "gpipe"), ("GPipe", "full", "gpipe"), ("1F1B", "none", "1f1b")]
GROWTH_M = (4, 8, 16)


def config(mesh: dict, virtual: int, once: bool, remat: str, schedule: str, tiny: bool,
           micro: int = MICROBATCHES, batch: int = 16):
    from ndjax.config import default_config

    c = default_config()
    c.mesh.update({"fsdp": 1, **mesh, "virtual_stages": virtual,
                   "pipeline_schedule": schedule})
    c.model.update(dict(preset="tiny" if tiny else "llama3_8b", remat=remat, dtype="bfloat16",
                        pipeline_gather_once=once))
    c.model.n_layers = 8  # 4 stages x 2 chunks of 1 (the tiny preset has 8 too)
    c.train.update(dict(batch_size=batch, seq_len=256 if tiny else 4096,
                        microbatches=micro if "stage" in mesh else 0))
    c.data.source = "synthetic"
    return c


def row(case: tuple, tiny: bool) -> str:
    from ndjax.config import Settings
    from ndjax.experiment import model_config
    from ndjax.hardware import roofline
    from ndjax.hardware.flops import flops_per_token
    from ndjax.planning import planner
    from ndjax.verbs.compile import compile_for

    label, mesh, virtual, once, remat, schedule = case
    c = config(mesh, virtual, once, remat, schedule, tiny)
    r = compile_for(c, "h100", 8)
    cfg = model_config(Settings.parse(c).model, platform="gpu")
    t = c.train
    tokens = t.batch_size * t.seq_len
    layout = planner.Layout(1, mesh.get("fsdp", 1), 1, mesh.get("tensor", 1), remat=remat,
                            stage=mesh.get("stage", 1), microbatches=t.microbatches,
                            virtual_stages=virtual, pipeline_schedule=schedule)
    flops = flops_per_token(cfg, t.seq_len) * tokens
    rerun = planner.pipeline_rerun_flops(cfg, t.seq_len, remat, layout) * tokens
    executed = planner.executed_flops(cfg, layout, flops + rerun, tokens)
    link = roofline.traffic(r["collectives"], 8)
    est = roofline.estimate(roofline.HARDWARE["h100"], link, flops, tokens, 8, remat, rerun,
                            executed_flops=executed)
    sent = {k: sum(x["bytes"] * x["executed"] for x in r["collectives"] if x["kind"] == k)
            for k in KINDS}
    plan = layout.schedule
    mesh_text = " x ".join(f"{a}={s}" for a, s in r["mesh"].items() if s > 1)
    return (f"| {label} | {mesh_text} | {remat} | {plan.ticks if plan else '-'} | "
            f"{f'{plan.bubble:.0%}' if plan else '-'} | {r['argument_bytes'] / GiB:.2f} | "
            f"{r['temp_bytes'] / GiB:.2f} | "
            + " | ".join(f"{sent[k] / GiB:.2f}" for k in KINDS)
            + f" | {est.serial_s * 1e3:,.1f} | {r['compile_s']:.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="smoke run: the tiny model, 3 rows")
    args = p.parse_args()
    os.environ["JAX_PLATFORMS"] = "cpu"  # the CUDA plugin's GPUs: compile-only targets
    from ndjax.hardware import gpu_target

    gpu_target.require()
    print(f"{datetime.date.today()}, {platform.processor() or platform.machine()}; "
          f"{'tiny' if args.tiny else 'llama3_8b, 8 of 32 layers'}, 16 x "
          f"{256 if args.tiny else 4096} tokens, bfloat16, 8 H100s, {MICROBATCHES} "
          "micro-batches with stages. GiB per device and step; roofline = compute at peak "
          "+ bytes over the links, not overlapped:\n")
    print("| schedule | mesh | remat | ticks | bubble | arguments | temporaries | "
          + " | ".join(KINDS) + " | roofline ms | compile s |\n"
          "|:--|:--|:--|--:|--:|--:|--:|" + "--:|" * len(KINDS) + "--:|--:|")
    for case in TINY_CASES if args.tiny else CASES:
        print(row(case, args.tiny), flush=True)
    if not args.tiny:
        growth()


def growth() -> None:
    """Temporaries per device as the micro-batches grow, 2 rows each."""
    from ndjax.verbs.compile import compile_for

    print("\nTemporaries (GiB per device) on stage=4 x fsdp=2 as the micro-batches grow, "
          "2 rows of 4096 tokens each (the batch grows with them):\n")
    print("| schedule | remat | " + " | ".join(f"M={m}" for m in GROWTH_M) + " |\n"
          "|:--|:--|" + "--:|" * len(GROWTH_M))
    for label, remat, schedule in GROWTH:
        temps = [compile_for(config(dict(stage=4, fsdp=2), 1, False, remat, schedule, False,
                                    micro=m, batch=2 * m), "h100", 8)["temp_bytes"] / GiB
                 for m in GROWTH_M]
        print(f"| {label} | {remat} | " + " | ".join(f"{t:.2f}" for t in temps) + " |",
              flush=True)


if __name__ == "__main__":
    main()
