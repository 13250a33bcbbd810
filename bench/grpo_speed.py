"""GRPO's step on CPU, split: the rollout (sampling with ndjax's own sampler on the
training mesh, then rewards and rows on the host) and the compiled train step on them.

    PYTHONPATH=. python bench/grpo_speed.py           # both models, 1 device and fsdp2xtp2
    PYTHONPATH=. python bench/grpo_speed.py --mesh 1  # 1 device only
    PYTHONPATH=. python bench/grpo_speed.py --tiny            # smoke run (tests/test_bench.py)

What runs is ``ndjax.training.grpo.step_fn``'s two halves, driven here one after the
other so that each is timed alone: ``Rollouts`` (``train.py``'s rollouts: the
``Generator`` over the state's weights, the reward function, advantages and rows) and
the experiment's compiled train step on those rows (``Experiment.step_fn``), with the
step's metrics read back (the step is finished) before the next rollout starts. The
loop's own ``step_time`` covers both halves; its ``rollout_time`` and
``rollout_tokens_per_sec`` are the same numbers as the columns here.

Per step: sampling s (the prefill and the decode loop, from ``rollout_tokens_per_sec``),
rewards s (the rest of ``rollout_time``: decoding the completions to text, the reward
function, advantages, building the rows), step s (the rows put on the devices, the
compiled step, its metrics read). Rollout tok/s: completion tokens sampled / sampling s
(what the loop logs as ``rollout_tokens_per_sec``); train tok/s: train.batch_size x
train.seq_len / step s (the loop's ``tokens_per_sec`` counts the same tokens over the
whole step, rollout included: the last column). Medians over steps 3..N: step 1
compiles the sampler's programs (the train step compiles before it; both shown apart),
step 2 may still warm up. Each layout runs in a fresh process (1 CPU device; 4 simulated
ones for fsdp=2 x tensor=2).

The data: prompts of about 32 tokens (a byte-level BPE tokenizer.json over Greek-letter
words, written to a temporary folder with the prompts), each sampled
``grpo.num_generations`` times at temperature 1 for up to
``grpo.max_completion_length`` tokens; the reward is the share of even token ids in a
completion (a module in the same folder, put on ``sys.path``). Random weights: the end
token is rarely drawn, so nearly every completion runs to its length.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ndjax.hardware.host import cpu_model
from ndjax.runtime.children import stop_children_on_signals

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon phi chi psi omega").split()
REWARD_MODULE = "grpo_bench_rewards"
REWARD_SOURCE = '''
def even_tokens(completions, completion_ids, **kwargs):
    """The share of a completion's tokens with an even id."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]
'''
# key -> (what the table calls it, model dims: the llama family): the tests' tiny model,
# and the ``tiny`` preset at 4 of its 8 layers (dim 256, vocab 2048).
MODELS = {
    "dim64": ("dim 64, 2 layers", dict(vocab_size=384, dim=64, n_layers=2, n_heads=8,
                                       n_kv_heads=4, ffn_dim=128, rope_theta=10_000.0)),
    "tiny4": ("tiny preset, 4 layers", dict(preset="tiny", n_layers=4)),
}
MESHES = {"1": dict(), "fsdp2xtp2": dict(fsdp=2, tensor=2)}
MESH_NAMES = {"1": "1 device", "fsdp2xtp2": "fsdp=2 x tensor=2"}


def devices_of(mesh: dict) -> int:
    return mesh.get("fsdp", 1) * mesh.get("tensor", 1)




def write_data(folder: Path, prompt_tokens: int) -> tuple[str, str]:
    """A tokenizer.json (with its tokenizer_config.json), prompts JSON Lines of up to
    ``prompt_tokens`` tokens each, and the reward module; the tokenizer's and prompts'
    paths."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = [" ".join(WORDS[(i * 7 + k * (i % 5 + 1)) % len(WORDS)] for k in range(64))
              for i in range(64)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    docs = []
    for text in corpus:  # each cut to the longest run of words within prompt_tokens
        words = text.split()
        while len(tok.encode(" ".join(words)).ids) > prompt_tokens:
            words.pop()
        docs.append(" ".join(words))
    tokenizer = folder / "tokenizer.json"
    tok.save(str(tokenizer))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
         "pad_token": "<pad>"}))
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": d}) + "\n" for d in docs))
    (folder / f"{REWARD_MODULE}.py").write_text(REWARD_SOURCE)
    return str(tokenizer), str(prompts)


def config(model: dict, mesh: dict, data: tuple[str, str], prompts: int, generations: int,
           completion: int, prompt_room: int):
    from ndjax.config import default_config

    c = default_config()
    c.model.update(model)
    c.mesh.update({**dict(replica=1, fsdp=1, context=1, tensor=1), **mesh})
    c.rules = "default"
    c.train.update(dict(objective="grpo", batch_size=prompts * generations,
                        seq_len=prompt_room + completion, lr=1e-5, schedule="constant",
                        warmup_steps=0, steps=1000))
    c.data.update(source="chat", format="prompt", tokenizer=data[0], files=data[1])
    c.grpo.update(dict(num_generations=generations, max_completion_length=completion,
                       reward_funcs=f"{REWARD_MODULE}.even_tokens"))
    c.log.tensorboard = False
    return c


def measure(name: str, mesh_name: str, data: tuple[str, str], steps: int, prompts: int,
            generations: int, completion: int, prompt_room: int) -> dict:
    import jax
    import numpy as np

    from ndjax.data.loader import open_loader
    from ndjax.experiment import Experiment
    from ndjax.training import grpo

    label, dims = MODELS[name]
    c = config(dims, MESHES[mesh_name], data, prompts, generations, completion,
               prompt_room)
    exp = Experiment.from_config(c, jax.devices()[:devices_of(MESHES[mesh_name])])
    state = exp.init_state()
    reference = exp.held_reference(state)
    rows_of = exp.data.batches.batch_size
    per_step = []
    with open_loader(exp.data, rows=(0, rows_of), prefetch=0) as loader:
        rollouts = grpo.Rollouts(exp, loader.source)
        started = time.perf_counter()
        train = exp.step_fn(reference)  # the train step compiles here
        compile_step = time.perf_counter() - started
        start, count = exp.local_rows
        for _, batch in zip(range(steps), loader):
            t0 = time.perf_counter()
            rows, m = rollouts(state.params, int(state.step), batch)
            t1 = time.perf_counter()
            local = {k: v[start:start + count] for k, v in rows.items()}
            state, metrics = train(state, exp.device_batch(local))
            loss = float(metrics["loss"])  # the step finished
            t2 = time.perf_counter()
            completion_tokens = m["completions/mean_length"] * c.train.batch_size
            sampling = completion_tokens / m["rollout_tokens_per_sec"]
            per_step.append(dict(sampling=sampling, rewards=m["rollout_time"] - sampling,
                                 rollout=t1 - t0, step=t2 - t1, total=t2 - t0,
                                 completion_tokens=completion_tokens, loss=loss,
                                 prompt_len=float(np.mean(batch["prompt_len"])),
                                 reward=m["reward"]))
    timed = per_step[2:] or per_step[-1:]
    med = {k: statistics.median(s[k] for s in timed) for k in per_step[0]}
    tokens = c.train.batch_size * c.train.seq_len
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(exp.abstract_state.params))
    return dict(model=label, mesh=MESH_NAMES[mesh_name], params=params, steps=len(per_step),
                timed=len(timed), batch=c.train.batch_size, seq_len=c.train.seq_len,
                tokens=tokens, compile_step=compile_step, first_step=per_step[0]["total"],
                first_sampling=per_step[0]["sampling"],
                rollout_tps=med["completion_tokens"] / med["sampling"],
                train_tps=tokens / med["step"], loop_tps=tokens / med["total"],
                **{k: med[k] for k in ("sampling", "rewards", "step", "total",
                                        "completion_tokens", "prompt_len")},
                losses=[s["loss"] for s in per_step], rewards_seen=[s["reward"] for s in per_step])


def table(results: list[dict]) -> None:
    print("| model | params | layout | rollout tok/s | train tok/s | sampling s | rewards s | "
          "step s | total s | sampling share | GRPO step tok/s | completion tokens | first "
          "step s (sampler compiles) | train step compile s |")
    print("|:--|--:|:--|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for r in results:
        print(f"| {r['model']} | {r['params'] / 1e6:.2f}M | {r['mesh']} | "
              f"{r['rollout_tps']:,.0f} | {r['train_tps']:,.0f} | {r['sampling']:.3f} | "
              f"{r['rewards']:.3f} | "
              f"{r['step']:.3f} | {r['total']:.3f} | {r['sampling'] / r['total']:.0%} | "
              f"{r['loop_tps']:,.0f} | {r['completion_tokens']:,.0f} | {r['first_step']:.2f} | "
              f"{r['compile_step']:.2f} |", flush=True)


def run_child(mesh: str, argv: list[str]) -> list[dict]:
    """One layout's rows, measured in a fresh process: the simulated device count must
    be set before jax starts, and one device should not share its process with four."""
    out = subprocess.run([sys.executable, __file__, *argv, "--one", mesh], capture_output=True,
                         text=True)
    if out.returncode != 0:  # the child's traceback, not only its exit status
        sys.stderr.write(out.stderr[-3000:])
        out.check_returncode()
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true",
                        help="smoke run: the small model, 3 steps of 2 prompts x 4 completions")
    parser.add_argument("--steps", type=int, default=8, help="steps per row (medians of 3..)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts a step")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt")
    parser.add_argument("--completion", type=int, default=64, help="max_completion_length")
    parser.add_argument("--prompt_room", type=int, default=32,
                        help="train.seq_len - max_completion_length: the longest prompt")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, of "
                        + "; ".join(f"{k} ({v[0]})" for k, v in MODELS.items()))
    parser.add_argument("--mesh", default="1,fsdp2xtp2",
                        help="comma-separated layouts, each in its own process: "
                        + ", ".join(f"{k} ({v})" for k, v in MESH_NAMES.items()))
    parser.add_argument("--one", choices=sorted(MESHES), help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    meshes = [m for m in args.mesh.split(",") if m]
    if args.tiny:
        args.steps, args.prompts, args.generations, args.completion, args.prompt_room = (
            3, 2, 4, 8, 32)
        models, meshes = [next(iter(MODELS))], ["1"]
    if args.one:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        import jax

        jax.config.update("jax_num_cpu_devices", devices_of(MESHES[args.one]))
        sys.path.insert(0, args.folder)  # the reward module
        data = (str(Path(args.folder) / "tokenizer.json"), str(Path(args.folder) / "prompts.jsonl"))
        print(json.dumps([measure(name, args.one, data, args.steps, args.prompts,
                                  args.generations, args.completion, args.prompt_room)
                          for name in models]))
        return
    stop_children_on_signals()  # a stopped run stops the layout it waits on
    import jax

    flags = " ".join(sys.argv[1:])
    print(f"`PYTHONPATH=. python bench/grpo_speed.py{' ' + flags if flags else ''}` on "
          f"{cpu_model()} ({os.cpu_count()} cores), jax {jax.__version__}, "
          f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; "
          f"{args.prompts} prompts x {args.generations} completions of up to "
          f"{args.completion} tokens, prompts of up to {args.prompt_room} tokens; medians of "
          f"steps 3..{args.steps}\n", flush=True)
    begun = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory() as folder:
        write_data(Path(folder), args.prompt_room)
        argv = [f"--steps={args.steps}", f"--prompts={args.prompts}",
                f"--generations={args.generations}", f"--completion={args.completion}",
                f"--prompt_room={args.prompt_room}", f"--models={','.join(models)}",
                f"--folder={folder}"]
        for mesh in meshes:
            results += run_child(mesh, argv)
    table(results)
    print()
    for r in results:
        print(f"{r['model']}, {r['mesh']}: batch {r['batch']} x {r['seq_len']} tokens; prompts "
              f"{r['prompt_len']:.1f} tokens; losses {', '.join(f'{x:.4f}' for x in r['losses'])}; "
              f"rewards {', '.join(f'{x:.3f}' for x in r['rewards_seen'])}")
    print(f"\nwall time: {time.perf_counter() - begun:.0f} s")


if __name__ == "__main__":
    main()
