"""The input pipeline on an SFT set: how full its rows are, and how fast it makes them.

A set of chat conversations (JSON Lines, the tests' byte-level BPE tokenizer with Llama
3's chat template) read by ``data.source=chat`` with packing, as an Axolotl SFT run
reads it: batch rows of ``--seq_len + 1`` tokens, ``--batch`` rows a step. For each
ndjax tree given (this one, and ``--before=DIR`` for another checkout, e.g. a git
worktree of an older commit), in a fresh process on the same files:

- open s: reading, rendering, tokenizing and packing, before the first batch;
- fill: real tokens / token slots, over the first ``--steps`` batches;
- conversations seen: distinct conversations in those batches / all of them;
- batches/s and tokens/s: the loader alone (no prefetch thread, no model), per step;
- with ``--train N``: N steps of train.py's loop on a tiny Llama (2 layers, width 64) over
  the same batches, its prefetch thread on, and the median ``data_wait`` (seconds the step
  waited for its batch, metrics.jsonl) and step time of steps 2..N (step 1 compiles).

    PYTHONPATH=. python bench/sft_input.py --conversations 10000 --before /tmp/ndjax_old
    PYTHONPATH=. python bench/sft_input.py --tiny   # smoke run: 200 conversations, 2 steps
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def make_set(folder: Path, n: int, seed: int = 0) -> tuple[str, str]:
    """``n`` conversations of 1-4 exchanges, replies of 10-300 words (an SFT set's spread:
    most short, some long), and the tokenizer; returns (jsonl path, tokenizer.json)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from data_files import WORDS, write_chat_tokenizer

    rng = np.random.default_rng(seed)
    say = lambda lo, hi: " ".join(rng.choice(WORDS, int(rng.integers(lo, hi))))  # noqa: E731
    path = folder / "sft.jsonl"
    with open(path, "w") as f:
        for i in range(n):
            chat = []
            for _ in range(int(rng.integers(1, 5))):
                reply = int(min(rng.lognormal(3.6, 0.9), 300))
                chat += [{"role": "user", "content": say(4, 60) + "?"},
                         {"role": "assistant", "content": say(max(reply, 10), max(reply, 10) + 1)}]
            f.write(json.dumps({"messages": chat, "id": i}) + "\n")
    return str(path), str(write_chat_tokenizer(folder / "tok", "llama3"))


def measure(files: str, tokenizer: str, batch: int, seq_len: int, steps: int,
            train_steps: int = 0) -> dict:
    """The figures of the ndjax on ``sys.path`` (run in a child process per tree)."""
    from ndjax.config import default_config
    from ndjax.data.loader import make_loader
    from ndjax.data.packing import unpack

    c = default_config()
    c.model.vocab_size = 384
    c.train.batch_size, c.train.seq_len = batch, seq_len
    c.data.update(source="chat", files=files, tokenizer=tokenizer, packing=True)
    started = time.perf_counter()
    loader = make_loader(c, 384, prefetch=0)
    opened = time.perf_counter() - started
    real, seen = 0, set()
    started = time.perf_counter()
    batches = [loader.batch(step) for step in range(steps)]
    took = time.perf_counter() - started
    for b in batches:
        real += int((b["segment_ids"] > 0).sum())
        for r in range(batch):
            row = {k: v[r] for k, v in b.items()}
            # A conversation by its first 32 tokens (its user text follows the header).
            seen.update(tuple(piece[:32].tolist()) for piece in unpack(row))
    loader.close()
    total = sum(1 for _ in open(files))
    out = {"open_s": opened, "fill": real / (steps * batch * seq_len),
           "seen": len(seen) / total, "batches_per_s": steps / took,
           "tokens_per_s": steps * batch * seq_len / took}
    if train_steps:
        out.update(train_wait(c, train_steps))
    return out


def train_wait(c, steps: int) -> dict:
    """Median data_wait and step seconds of steps 2..``steps`` of a tiny model's run."""
    from ndjax.training.loop import train

    c.model.update(vocab_size=384, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)
    c.train.update(steps=steps, warmup_steps=0)
    c.log.tensorboard = False
    with tempfile.TemporaryDirectory() as work:
        train(c, work, verbose=False)
        records = [json.loads(line) for line in open(os.path.join(work, "metrics.jsonl"))]
    later = [r for r in records if r.get("step", 0) >= 2 and "data_wait" in r]
    return {"data_wait_s": float(np.median([r["data_wait"] for r in later])),
            "step_s": float(np.median([r["step_time"] for r in later]))
            if all("step_time" in r for r in later) else float("nan")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=10_000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--before", help="another ndjax checkout to measure beside this one")
    p.add_argument("--train", type=int, default=0, metavar="N",
                   help="also train a tiny model N steps on the set and report data_wait")
    p.add_argument("--tiny", action="store_true", help="smoke run: a small set, 2 steps")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # files, tokenizer
    a = p.parse_args()
    if a.tiny:
        a.conversations, a.batch, a.seq_len, a.steps = 200, 8, 512, 2
    if a.child:
        print(json.dumps(measure(*a.child, a.batch, a.seq_len, a.steps, a.train)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        files, tok = make_set(Path(tmp), a.conversations)
        rows = []
        for name, tree in (("before", a.before), ("this tree", str(ROOT))):
            if tree is None:
                continue
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, str(ROOT / "tests")])}
            out = subprocess.run([sys.executable, __file__, "--child", files, tok,
                                  f"--batch={a.batch}", f"--seq_len={a.seq_len}",
                                  f"--steps={a.steps}", f"--train={a.train}"], cwd=tree, env=env,
                                 capture_output=True, text=True)
            if out.returncode:  # a tree that refuses the set: its one-line error
                rows.append((name, tree, out.stderr.strip().splitlines()[-1]))
            else:
                rows.append((name, tree, json.loads(out.stdout.strip().splitlines()[-1])))
    print(f"{a.conversations} conversations, batch {a.batch} x {a.seq_len} tokens, "
          f"first {a.steps} steps")
    trained = " data_wait s | step s |" if a.train else ""
    print("| tree | open s | fill | conversations seen | batches/s | tokens/s |" + trained)
    print("|:--|--:|--:|--:|--:|--:|" + ("--:|--:|" if a.train else ""))
    for name, _, r in rows:
        if isinstance(r, str):
            print(f"| {name} | refused: {r} | | | | |" + (" | |" if a.train else ""))
            continue
        waits = f" {r['data_wait_s']:.4f} | {r['step_s']:.2f} |" if a.train else ""
        print(f"| {name} | {r['open_s']:.1f} | {100 * r['fill']:.1f}% | {100 * r['seen']:.1f}% "
              f"| {r['batches_per_s']:.1f} | {r['tokens_per_s']:,.0f} |" + waits)


if __name__ == "__main__":
    main()
