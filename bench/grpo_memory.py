"""GRPO on the training mesh, memory per GPU: the sampler's two programs (prefill, the
decode loop with its KV cache) and the GRPO train step, compiled by XLA's GPU compiler
for GPUs this machine does not have (``ndjax compile``'s figures; the gpu-compile extra).

    PYTHONPATH=. python bench/grpo_memory.py            # Llama 3 8B on 8 H100s
    PYTHONPATH=. python bench/grpo_memory.py --layers 4 # 4 of its 32 layers
    PYTHONPATH=. python bench/grpo_memory.py --tiny     # smoke run (tests/test_gpu_compile.py)

Every variant: fsdp=8 (``configs/llama_fsdp.py``, rules default), bfloat16 compute,
``model.remat=full`` (as ``configs/llama3_sft.py`` and bench/preference_memory.py),
train.objective=grpo with train.batch_size 64 completions (8 prompts x
grpo.num_generations 8) of train.seq_len 1536 tokens, grpo.max_completion_length 1024,
so prompts of up to 512 tokens; train.loss_chunk 768 (the default 1024 must divide
train.seq_len, and does not divide 1536: refused in one line). Full fine-tuning keeps
float32 weights and Adam moments (``model.param_dtype=auto``); LoRA is r=16, alpha 32 on
every projection over a bfloat16 base. grpo.beta > 0 (the KL term) holds a frozen copy of
the starting weights under full fine-tuning (``held``: the step's third argument, sharded
like the trained weights) and takes the base with the adapters off under LoRA
(``adapters_off``: no copy).

The sampler is ``ndjax.training.grpo.Rollouts``' own ``Generator`` (the training
experiment's graph, rules and parameters: the state's weights, float32 under full
fine-tuning), compiled ahead (``Generator.compile_ahead``, what ``ndjax compile
--step=decode`` reads) for the step's 64 completions of prompts up to 512 tokens: its
prefill (prompt slots 512, a KV cache of 512 + 1024 slots) and its decode loop (the
cache donated, updated in place). The train step is ``compile_for``'s (``ndjax
compile``).

Per device (``memory_analysis``): arguments, temporaries, output (and what of it is
aliased to donated arguments). The KV cache's bytes come from prefill's output shapes
and shardings. The two programs and the step run on the same devices one after the
other, with the train state resident throughout: the peak a GRPO step needs is the
state (the train step's arguments: weights, optimizer state, held reference, batch)
plus the largest of what each program adds on top of it: the step's temporaries;
prefill's temporaries and output (the new cache); decode's temporaries, its
arguments beyond the weights (the cache) and its unaliased output. The decode loop's
collectives per token step are read from its HLO (``per_token_step``). Not counted:
cuBLAS/cuDNN workspaces, the CUDA context, allocator fragmentation
(docs/compile-and-plan.md); the host side of a rollout (token lists, rewards).
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
BETA = 0.04  # TRL's GRPO KL weight before it defaulted to 0
# (training, grpo.beta, model.lora)
VARIANTS = [
    ("full", 0.0, None),
    ("full", BETA, None),
    ("LoRA r=16", 0.0, LORA),
    ("LoRA r=16", BETA, LORA),
]
# The smoke run: full fine-tuning with grpo.beta > 0 (the held reference); 2 layers of
# the tiny model; figures in MiB.
TINY = VARIANTS[1:2]
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon phi chi psi omega").split()
REWARD = "ndjax.rewards.format.think_answer"




def write_data(folder: Path) -> tuple[str, str]:
    """A byte-level BPE tokenizer.json (with its tokenizer_config.json: the end and pad
    tokens) and a JSON Lines file of short prompts; their paths. The step's shapes come
    from the config, not from these prompts."""
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
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
         "pad_token": "<pad>"}))
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": d}) + "\n" for d in docs))
    return str(tokenizer), str(prompts)


def config(preset: str, layers: int | None, shape: dict, beta: float, lora: dict | None,
           data: tuple[str, str]):
    from ndjax.config import default_config

    c = default_config()
    c.mesh.fsdp = 8
    c.rules = "default"
    c.model.update(dict(preset=preset, remat="full", dtype="bfloat16"))
    if layers:
        c.model.n_layers = layers
    if lora:
        c.model.lora.update(lora)
    c.train.update(dict(objective="grpo", batch_size=shape["batch"], seq_len=shape["seq"]))
    if c.train.loss_chunk < shape["seq"] and shape["seq"] % c.train.loss_chunk:
        # 1536: the default 1024 does not divide it
        c.train.loss_chunk = shape["seq"] // 2
    c.data.update(dict(source="chat", format="prompt", tokenizer=data[0], files=data[1]))
    c.grpo.update(dict(num_generations=shape["generations"],
                       max_completion_length=shape["completion"], beta=beta,
                       reward_funcs=REWARD))
    return c


def sampler(config, hardware: str, n: int, shape: dict) -> dict:
    """The rollouts' prefill and decode loop compiled for ``n`` GPUs; their memory per
    device, the KV cache's and the weights' (the state's parameters) bytes per device,
    and the experiment's parts (weights, optimizer, held reference, batch)."""
    from ndjax.experiment import Experiment
    from ndjax.hardware import gpu_target
    from ndjax.planning.planner import bytes_per_device
    from ndjax.runtime.console import native_stderr
    from ndjax.training.grpo import Rollouts

    with native_stderr():
        exp = Experiment.from_config(config, gpu_target.devices(gpu_target.hardware(hardware), n))
        state = exp.abstract_state
        gen = Rollouts(exp, None).generator  # the run's sampler, as Rollouts builds it
        gen.params = state.params
        started = time.perf_counter()
        with exp.for_target():
            prefill, decode = gen.compile_ahead(shape["batch"], shape["seq"] - shape["completion"])
        seconds = time.perf_counter() - started
    rows, slots = gen.shapes(shape["batch"], shape["seq"] - shape["completion"])
    cache = jax_tree_bytes(prefill)
    held = exp.trainable(state.params) if exp.reference_mode == "held" else {}
    out = dict(mode=exp.reference_mode, params=bytes_per_device(state.params),
               optimizer=bytes_per_device((state.step, state.opt_state)),
               reference=bytes_per_device(held), batch=bytes_per_device(exp.abstract_batch),
               cache=cache, rows=rows, slots=slots, cache_slots=slots + gen.max_new,
               sampler_s=seconds)
    out.update(per_token_step(decode))
    for name, program in (("prefill", prefill), ("decode", decode)):
        m = program.memory_analysis()
        out[name] = dict(args=int(m.argument_size_in_bytes), temps=int(m.temp_size_in_bytes),
                         output=int(m.output_size_in_bytes), alias=int(m.alias_size_in_bytes))
    return out


def jax_tree_bytes(prefill) -> int:
    """The KV cache's bytes per device: prefill's second output, by its shardings."""
    import math

    import jax

    _, cache = prefill.out_info
    _, shardings = prefill.output_shardings
    return sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
               for x, s in zip(jax.tree.leaves(cache), jax.tree.leaves(shardings)))


def per_token_step(decode) -> dict[str, float]:
    """The decode program's collectives over one trip of its token loop (a
    ``lax.while_loop`` whose trips depend on the end tokens drawn, so
    ``ndjax.parallel.collectives``' per-step count refuses it): result bytes per device
    and ring bytes sent per device, each loop of known trips (the layers' scan) counted
    its trips, the token loop once."""
    from ndjax.parallel import collectives as coll  # its HLO reader's pieces

    mod = coll._parse(decode.as_text())
    runs: dict[str, int] = {}

    def visit(comp: str, times: int) -> None:
        runs[comp] = runs.get(comp, 0) + times
        for ins in mod.comps.get(comp, []):
            for attr, callee in coll._callees(ins):
                trips = coll._trip_count(ins) if ins.op == "while" and attr in (
                    "body", "condition") else 1
                visit(callee, times * (trips or 1))

    visit(mod.entry, 1)
    found = [c for comp, instrs in mod.comps.items() for ins in instrs if coll._kind(ins.op)
             for c in coll._of(mod, comp, ins, runs.get(comp, 0), cpu_compiled=False)]
    return dict(gathered=sum(c.moved_bytes * c.executed for c in found
                             if c.kind == "all-gather"),
                sent=sum(c.ring_bytes * c.executed for c in found))


def measure(preset: str, layers: int | None, shape: dict, hardware: str,
            data: tuple[str, str], variants=VARIANTS) -> list[dict]:
    from ndjax.verbs.compile import compile_for

    rows = []
    for training, beta, lora in variants:
        c = config(preset, layers, shape, beta, lora, data)
        r = compile_for(c, hardware, 8)  # compile_s: from_config + the compile, wall time
        r.pop("hlo")
        rows.append(dict(r, training=training, beta=beta, **sampler(c, hardware, 8, shape)))
    return rows


def needs(r: dict) -> dict[str, int]:
    """What each program adds on top of the resident train state, and the peak."""
    p, d = r["prefill"], r["decode"]
    add = {"step": r["temp_bytes"] + r["output_bytes"] - r["alias_bytes"],
           "prefill": p["args"] - r["params"] + p["temps"] + p["output"] - p["alias"],
           "decode": d["args"] - r["params"] + d["temps"] + d["output"] - d["alias"]}
    largest = max(add, key=add.get)
    return dict(add, largest=largest, resident=r["argument_bytes"],
                peak=r["argument_bytes"] + add[largest],
                simple=r["params"] + max(r["temp_bytes"], p["temps"], d["temps"]))


def table(rows: list[dict], nvlink_gbs: float, unit: str = "GiB") -> None:
    def g(n: int) -> str:
        return f"{n / (GiB if unit == 'GiB' else MiB):,.2f}"

    u = unit
    print(f"Per program ({u} per device; total = arguments + temporaries, as `ndjax compile` "
          "counts it; the sampler's compile s: prefill and decode together, the train step's: "
          "`compile_for`'s wall time, Experiment.from_config included):\n")
    print(f"| training | grpo.beta | reference | program | arguments {u} | temporaries {u} | "
          f"output {u} (aliased) | total {u} | of the GPU's | compile s |")
    print("|:--|--:|:--|:--|--:|--:|--:|--:|--:|--:|")
    for r in rows:
        gpu = r["gpu_memory_bytes"]
        for name in ("prefill", "decode"):
            m = r[name]
            total = m["args"] + m["temps"]
            seconds = f"{r['sampler_s']:.1f}" if name == "prefill" else "(with prefill)"
            print(f"| {r['training']} | {r['beta']:g} | {r['mode']} | sampler {name} | "
                  f"{g(m['args'])} | {g(m['temps'])} | {g(m['output'])} ({g(m['alias'])}) | "
                  f"{g(total)} | {total / gpu:.0%} | "
                  f"{seconds} |")
        total = r["argument_bytes"] + r["temp_bytes"]
        print(f"| {r['training']} | {r['beta']:g} | {r['mode']} | train step | "
              f"{g(r['argument_bytes'])} | {g(r['temp_bytes'])} | {g(r['output_bytes'])} "
              f"({g(r['alias_bytes'])}) | {g(total)} | {total / gpu:.0%} | "
              f"{r['compile_s']:.1f} |", flush=True)
    print(f"\nThe step's peak ({u} per device): the train state stays resident while the "
          "sampler runs, so the peak is the resident state plus the largest of what each "
          "program adds to it; \"weights + temporaries\" is the weights plus the largest of "
          "the three programs' temporaries.\n")
    print(f"| training | grpo.beta | weights {u} | optimizer {u} | held reference {u} | batch "
          f"MiB | KV cache {u} | resident (step arguments) {u} | step adds {u} | prefill adds "
          f"{u} | decode adds {u} | peak {u} | of the GPU's | weights + temporaries {u} |")
    print("|:--|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for r in rows:
        n = needs(r)
        other = r["argument_bytes"] - r["params"] - r["optimizer"] - r["reference"] - r["batch"]
        assert abs(other) < MiB, (r["training"], r["beta"], other)  # the split adds up
        mark = {k: (f"**{g(n[k])}**" if n["largest"] == k else g(n[k]))
                for k in ("step", "prefill", "decode")}
        print(f"| {r['training']} | {r['beta']:g} | {g(r['params'])} | {g(r['optimizer'])} | "
              f"{g(r['reference'])} | {r['batch'] / MiB:,.2f} | {g(r['cache'])} | "
              f"{g(n['resident'])} | {mark['step']} | {mark['prefill']} | {mark['decode']} | "
              f"{g(n['peak'])} | {n['peak'] / r['gpu_memory_bytes']:.0%} | {g(n['simple'])} |",
              flush=True)
    print(f"\nThe sampler on the training mesh: the decode loop's collectives per token "
          f"step, per device (FSDP gathers each layer's weights for every token), and the "
          f"time they take at least at NVLink's {nvlink_gbs:.0f} GB/s one way (no compute, "
          "no latency, no overlap), per token and for a completion of max_completion_length "
          "tokens:\n")
    print(f"| training | all-gathered per token {u} | ring bytes sent per token {u} | "
          "ms per token (at least) | s per completion (at least) |")
    print("|:--|--:|--:|--:|--:|")
    seen = set()
    for r in rows:
        if r["training"] in seen:  # grpo.beta does not change the sampler
            continue
        seen.add(r["training"])
        ms = r["sent"] / (nvlink_gbs * 1e9) * 1e3
        new_tokens = r["cache_slots"] - r["slots"]
        print(f"| {r['training']} | {g(r['gathered'])} | {g(r['sent'])} | {ms:.2f} | "
              f"{ms * new_tokens / 1e3:.1f} |")
    print()
    by = {(r["training"], r["beta"]): r for r in rows}
    for (training, beta), r in by.items():
        base = by.get((training, 0.0))
        if beta and base:
            print(f"{training}, grpo.beta={beta:g} against 0: train step arguments "
                  f"{(r['argument_bytes'] - base['argument_bytes']) / MiB:+,.1f} MiB, "
                  f"temporaries {(r['temp_bytes'] - base['temp_bytes']) / MiB:+,.1f} MiB")
    r = rows[0]
    print(f"sampler: {r['rows']} rows x {r['slots']} prompt slots, a KV cache of "
          f"{r['cache_slots']} slots; attention in the train step: "
          f"{', '.join(sorted({x['attention'] for x in rows}))}")


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
    if args.tiny:  # 2 layers; 2 prompts x 8 completions of 64 tokens after 64
        preset, shape = "tiny", dict(batch=16, generations=8, seq=128, completion=64)
    else:
        preset, shape = "llama3_8b", dict(batch=64, generations=8, seq=1536, completion=1024)
    layers = 2 if args.tiny else args.layers
    flags = " ".join(sys.argv[1:])
    print(f"`PYTHONPATH=. python bench/grpo_memory.py{' ' + flags if flags else ''}` on "
          f"{cpu_model()} ({os.cpu_count()} cores, no GPU), "
          f"jax {jax.__version__}, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} "
          f"UTC; {preset}{f' ({layers} layers)' if layers else ''} compiled for 8 x "
          f"{roofline.HARDWARE[args.hardware].name}, fsdp=8, train.batch_size "
          f"{shape['batch']} ({shape['batch'] // shape['generations']} prompts x "
          f"{shape['generations']}) x seq_len {shape['seq']}, max_completion_length "
          f"{shape['completion']}, bfloat16, remat full\n")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        data = write_data(Path(folder))
        rows = measure(preset, layers, shape, args.hardware, data,
                       TINY if args.tiny else VARIANTS)
    table(rows, roofline.HARDWARE[args.hardware].nvlink_gbs, "MiB" if args.tiny else "GiB")
    print(f"\nall {3 * len(rows)} compiles: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
