"""Generation throughput: prefill and decode tokens/s of the KV-cache sampler.

The ``tiny`` preset (vocab 2048, dim 256, 8 layers, 8 heads / 4 kv heads),
random weights, greedy, no end-of-sequence token (every row decodes all its
tokens). Each layout runs in a fresh subprocess, since the simulated device
count must be set before jax starts: 1 CPU device, and 8 simulated CPU devices
as fsdp=4 x tensor=2 (rows over fsdp, heads and the cache's kv heads over
tensor; each layer's weights gathered over fsdp at every step, as in training)
and as replica=4 x tensor=2 (rows over replica, no gathers). Prefill is timed
over the whole left-padded batch (rows x prompt tokens); decode over the
``lax.while_loop`` of new tokens - 1 steps (the prefill samples the first). The
first call of each compiles and is reported apart; the rest are the median of
``--repeats`` calls.

Run from the repo root:

    PYTHONPATH=. python bench/generate.py --batch 8 --prompt 128 --new 64 --repeats 5
    PYTHONPATH=. python bench/generate.py --tiny   # smoke run: 2 layers, a few tokens
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from ndjax.runtime.children import stop_children_on_signals

LAYOUTS = {"1 device": (1, {}), "fsdp=4 x tensor=2": (8, {"fsdp": 4, "tensor": 2}),
           # The same without FSDP: rows over replica, weights whole on each tensor shard.
           "replica=4 x tensor=2": (8, {"replica": 4, "tensor": 2})}


def one(devices: int, mesh: dict[str, int], a: argparse.Namespace) -> dict[str, float]:
    """Builds the model on this layout and times prefill and decode in this process."""
    import jax

    jax.config.update("jax_num_cpu_devices", devices)
    import numpy as np

    from ndjax.config import default_config
    from ndjax.experiment import Experiment
    from ndjax.models.sampling import Generator
    from ndjax.parallel import rules as rules_lib
    from ndjax.verbs.generate import for_generation

    c = default_config()
    c.model.preset = "tiny"
    if a.layers:
        c.model.n_layers = a.layers
    c.mesh.update(dict(replica=1, fsdp=1, context=1, tensor=1) | mesh)
    exp = Experiment.from_config(for_generation(c, devices))
    params = exp.init_state().params
    g = Generator(exp.graphdef, params, exp.model_cfg, exp.rules, max_new_tokens=a.new,
                  max_len=a.prompt + a.new)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, exp.model_cfg.vocab_size, a.prompt).tolist()
               for _ in range(a.batch)]
    prefill_s, decode_s = [], []
    with rules_lib.use(g.rules):
        tokens, pad = g.inputs(prompts)
        for _ in range(a.repeats + 1):  # the first call compiles
            t0 = time.perf_counter()
            first, cache = jax.block_until_ready(g.prefill(params, tokens, pad, g.key))
            t1 = time.perf_counter()
            out, _ = jax.block_until_ready(g.decode(params, first, cache, g.key, a.batch))
            t2 = time.perf_counter()
            prefill_s.append(t1 - t0)
            decode_s.append(t2 - t1)
    assert np.asarray(out).shape == (a.batch, a.new)
    pre, dec = statistics.median(prefill_s[1:]), statistics.median(decode_s[1:])
    return {"prefill_tok_s": a.batch * a.prompt / pre, "decode_tok_s": a.batch * (a.new - 1) / dec,
            "decode_ms_step": 1e3 * dec / (a.new - 1), "first_prefill_s": prefill_s[0],
            "first_decode_s": decode_s[0]}


def run_child(layout: str, argv: list[str]) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, *argv, "--one", layout], capture_output=True,
                         text=True)
    if out.returncode != 0:  # the child's traceback, not only its exit status
        sys.stderr.write(out.stderr[-3000:])
        out.check_returncode()
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8, help="prompts (rows) per batch")
    p.add_argument("--prompt", type=int, default=128, help="tokens per prompt")
    p.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=0, help="override the preset's 8 layers")
    p.add_argument("--tiny", action="store_true",
                   help="smoke run: 2 layers, 16-token prompts, 8 new tokens, 1 repeat")
    p.add_argument("--one", choices=sorted(LAYOUTS), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.tiny:
        a.layers, a.prompt, a.new, a.repeats = 2, 16, 8, 1
    if a.one:
        print(json.dumps(one(*LAYOUTS[a.one], a)))
        return
    stop_children_on_signals()  # a stopped sweep stops the layout it waits on
    argv = [f"--batch={a.batch}", f"--prompt={a.prompt}", f"--new={a.new}",
            f"--repeats={a.repeats}", f"--layers={a.layers}"]
    print(f"tiny preset{f', {a.layers} layers' if a.layers else ''}; batch {a.batch} x "
          f"{a.prompt} prompt tokens, {a.new} new tokens; median of {a.repeats} after the "
          "compiling call\n")
    print("| layout | prefill tok/s | decode tok/s | decode ms/step | first prefill s "
          "| first decode s |")
    print("|:-------|--------------:|-------------:|---------------:|----------------:"
          "|---------------:|")
    for layout in LAYOUTS:
        r = run_child(layout, argv)
        print(f"| {layout} | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.0f} | "
              f"{r['decode_ms_step']:.1f} | {r['first_prefill_s']:.2f} | "
              f"{r['first_decode_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
