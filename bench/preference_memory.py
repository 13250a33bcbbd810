"""Preference objectives' memory per GPU: the train step of SFT, DPO (with a held
reference model) and ORPO, full fine-tuning, LoRA and QLoRA, compiled by XLA's GPU
compiler for GPUs this machine does not have (``ndjax compile``'s figures; the
gpu-compile extra).

    PYTHONPATH=. python bench/preference_memory.py            # Llama 3 8B on 8 H100s
    PYTHONPATH=. python bench/preference_memory.py --layers 4 # 4 of its 32 layers
    PYTHONPATH=. python bench/preference_memory.py --tiny     # smoke run (tests/test_bench.py)

Every row: fsdp=8 (``configs/llama_fsdp.py``, rules default), bfloat16 compute,
``model.remat=full`` (as ``configs/llama3_sft.py``), a global batch of 8 rows of 4096
tokens (one row per GPU; a preference row holds a chosen and a rejected sequence, e.g.
two of 2048). Full fine-tuning keeps float32 weights and Adam moments
(``model.param_dtype=auto``); LoRA is r=16, alpha 32 on every projection over a bfloat16
base; QLoRA the same adapters over an NF4 base. DPO without LoRA holds a frozen copy of
the starting weights (``preference.reference=frozen_copy``, "held"), passed to the step
beside the state and sharded like the trained weights; DPO under LoRA takes the base with
the adapters off as its reference (``adapters_off``: no copy). ORPO has no reference.

Per device: the step's arguments (``memory_analysis``), split into the weights, the
optimizer state, the held reference and the batch from the abstract state's shards
(``ndjax.planning.planner.bytes_per_device``); temporaries; output (aliased to the
donated state); total = arguments + temporaries, as ``ndjax compile`` counts it. Not
counted: cuBLAS/cuDNN workspaces (docs/compile-and-plan.md).

The preference and SFT steps read the same batch fields, so the data source does not
change the step: SFT uses data.source=synthetic, the preference objectives
data.source=chat, data.format=preference over a small JSON Lines file and a tokenizer.json
this script writes to a temporary folder (the config's data checks open both).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from ndjax.hardware.host import cpu_model

GiB, MiB = 2**30, 2**20
LORA = dict(rank=16, alpha=32.0, target_modules="all-linear")
QLORA = dict(LORA, quantize="nf4", quant_block=64)  # bitsandbytes' default block
# (objective, training, preference.reference, model.lora)
VARIANTS = [
    ("sft", "full", "auto", None),
    ("dpo", "full", "frozen_copy", None),
    ("orpo", "full", "auto", None),
    ("sft", "LoRA r=16", "auto", LORA),
    ("dpo", "LoRA r=16", "adapters_off", LORA),
    ("sft", "QLoRA r=16, NF4", "auto", QLORA),
    ("dpo", "QLoRA r=16, NF4", "adapters_off", QLORA),
]
# The smoke run: sft and dpo with a held reference (the step's third argument), full
# fine-tuning; 2 layers of the tiny model, 128 tokens; figures in MiB.
TINY = VARIANTS[:2]
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon phi chi psi omega").split()




def write_data(folder: Path) -> tuple[str, str]:
    """A byte-level BPE tokenizer.json (as tests/data_files.py's ``write_tokenizer``) and a
    JSON Lines file of preference records; their paths."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    docs = [" ".join(WORDS[(i + k) % len(WORDS)] for k in range(12)) for i in range(32)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(docs, trainer)
    tokenizer = folder / "tokenizer.json"
    tok.save(str(tokenizer))
    pairs = folder / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": d[:30], "chosen": d[30:], "rejected":
                                         d[30:][::-1]}) + "\n" for d in docs))
    return str(tokenizer), str(pairs)


def config(preset: str, layers: int | None, batch: int, seq: int, objective: str,
           reference: str, lora: dict | None, data: tuple[str, str], quant_block: int):
    from ndjax.config import default_config

    c = default_config()
    c.mesh.fsdp = 8
    c.rules = "default"
    c.model.update(dict(preset=preset, remat="full", dtype="bfloat16"))
    if layers:
        c.model.n_layers = layers
    if lora:
        c.model.lora.update(lora)
        if "quantize" in lora:
            c.model.lora.quant_block = quant_block
    c.train.update(dict(batch_size=batch, seq_len=seq, objective=objective))
    c.preference.reference = reference
    if objective == "sft":
        c.data.source = "synthetic"
    else:
        c.data.update(dict(source="chat", format="preference", tokenizer=data[0],
                           files=data[1]))
    return c


def parts(config, hardware: str, n: int) -> dict[str, int]:
    """The arguments' parts on one device, from the experiment's abstract state (built
    again, not compiled): weights, optimizer state (with the step), held reference, batch."""
    from ndjax.experiment import Experiment
    from ndjax.hardware import gpu_target
    from ndjax.planning.planner import bytes_per_device
    from ndjax.runtime.console import native_stderr

    with native_stderr():
        exp = Experiment.from_config(config, gpu_target.devices(gpu_target.hardware(hardware), n))
    state = exp.abstract_state
    held = exp.trainable(state.params) if exp.reference_mode == "held" else {}
    return dict(mode=exp.reference_mode, params=bytes_per_device(state.params),
                optimizer=bytes_per_device((state.step, state.opt_state)),
                reference=bytes_per_device(held), batch=bytes_per_device(exp.abstract_batch))


def measure(preset: str, layers: int | None, batch: int, seq: int, hardware: str,
            quant_block: int, data: tuple[str, str], variants=VARIANTS) -> list[dict]:
    from ndjax.verbs.compile import compile_for

    rows = []
    for objective, training, reference, lora in variants:
        c = config(preset, layers, batch, seq, objective, reference, lora, data, quant_block)
        r = compile_for(c, hardware, 8)  # compile_s: from_config + the compile, wall time
        r.pop("hlo")
        rows.append(dict(r, objective=objective, training=training, **parts(c, hardware, 8)))
    return rows


def table(rows: list[dict], unit: str = "GiB") -> None:
    def g(n: int) -> str:
        return f"{n / (GiB if unit == 'GiB' else MiB):,.2f}"

    u = unit
    print(f"| objective | training | reference | weights {u} | optimizer {u} | held reference "
          f"{u} | batch MiB | arguments {u} | temporaries {u} | output {u} (aliased) | total "
          f"{u} | of the GPU's | compile s |")
    print("|:--|:--|:--|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for r in rows:
        total = r["argument_bytes"] + r["temp_bytes"]
        other = r["argument_bytes"] - r["params"] - r["optimizer"] - r["reference"] - r["batch"]
        assert abs(other) < MiB, (r["objective"], r["training"], other)  # the split adds up
        print(f"| {r['objective']} | {r['training']} | {r['mode']} | {g(r['params'])} | "
              f"{g(r['optimizer'])} | {g(r['reference'])} | {r['batch'] / MiB:,.2f} | "
              f"{g(r['argument_bytes'])} | {g(r['temp_bytes'])} | {g(r['output_bytes'])} "
              f"({g(r['alias_bytes'])}) | {g(total)} | {total / r['gpu_memory_bytes']:.0%} | "
              f"{r['compile_s']:.1f} |", flush=True)
    print()
    print("| ratio | training | arguments | temporaries | total | compile s |")
    print("|:--|:--|--:|--:|--:|--:|")
    by = {(r["objective"], r["training"]): r for r in rows}
    for (objective, training), r in by.items():
        sft = by.get(("sft", training))
        if objective == "sft" or sft is None:
            continue
        print(f"| {objective} / sft | {training} | "
              f"{r['argument_bytes'] / sft['argument_bytes']:.3f} | "
              f"{r['temp_bytes'] / sft['temp_bytes']:.3f} | "
              f"{(r['argument_bytes'] + r['temp_bytes']) / (sft['argument_bytes'] + sft['temp_bytes']):.3f} | "  # noqa: E501
              f"{r['compile_s'] / sft['compile_s']:.2f} |")
    print()
    print(f"attention: {', '.join(sorted({r['attention'] for r in rows}))}")
    for r in rows:
        if r["reference"]:
            trained = r["trainable_param_bytes"]
            print(f"{r['objective']} {r['training']}: the held reference is "
                  f"{r['reference'] / trained:.3f}x the trained weights' bytes per device "
                  f"({g(r['reference'])} of {g(trained)} {unit}); arguments above sft's: "
                  f"{g(r['argument_bytes'] - by[('sft', r['training'])]['argument_bytes'])} "
                  f"{unit}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny preset, a smoke run")
    parser.add_argument("--layers", type=int, default=None,
                        help="compile this many of the model's layers (default: all)")
    parser.add_argument("--hardware", default="h100")
    args = parser.parse_args()
    os.environ["JAX_PLATFORMS"] = "cpu"
    from ndjax.runtime.console import native_stderr

    with native_stderr():
        import jax
        jax.config.update("jax_num_cpu_devices", 8)
        jax.devices()
    from ndjax.hardware import gpu_target, roofline

    gpu_target.require()
    preset, batch, seq, block = ("tiny", 8, 128, 32) if args.tiny else ("llama3_8b", 8, 4096, 64)
    layers = 2 if args.tiny else args.layers
    flags = " ".join(sys.argv[1:])
    print(f"`PYTHONPATH=. python bench/preference_memory.py{' ' + flags if flags else ''}` on "
          f"{cpu_model()} ({os.cpu_count()} cores, no GPU), "
          f"jax {jax.__version__}, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} "
          f"UTC; {preset}{f' ({layers} layers)' if layers else ''} compiled for 8 x "
          f"{roofline.HARDWARE[args.hardware].name}, fsdp=8, batch {batch} x {seq}, bfloat16, "
          "remat full\n")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        data = write_data(Path(folder))
        rows = measure(preset, layers, batch, seq, args.hardware, block, data,
                       TINY if args.tiny else VARIANTS)
    table(rows, "MiB" if args.tiny else "GiB")
    print(f"\nall {len(rows)} compiles: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
