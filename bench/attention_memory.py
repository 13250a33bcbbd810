"""Train-step memory against the sequence length, attention kernel by kernel.

Compiles the train step ahead of time on one CPU device (nothing is allocated or
run) for the ``tiny`` preset cut to one layer, batch 1, float32, remat none, and
reads ``compiled.memory_analysis().temp_size_in_bytes``, for ``dense``, ``tiled``
and what ``auto`` picks, at each sequence length. Linear memory means 4x the
tokens cost about 4x the bytes; dense attention's (seq x seq) scores cost 16x.

    PYTHONPATH=. python bench/attention_memory.py           # 4096, 8192, 16384 tokens
    PYTHONPATH=. python bench/attention_memory.py --tiny    # smoke run, seconds
"""

from __future__ import annotations

import argparse
import platform

MiB = 2**20


def temp_bytes(impl: str, seq_len: int) -> tuple[str, float]:
    import jax

    from ndjax.config import default_config
    from ndjax.experiment import Experiment

    c = default_config()
    c.model.update(dict(preset="tiny", n_layers=1, dtype="float32", remat="none",
                        attn_impl=impl))
    c.mesh.update(dict(replica=1, fsdp=1, context=1, tensor=1))
    c.train.update(dict(batch_size=1, seq_len=seq_len))
    c.data.source = "synthetic"
    exp = Experiment.from_config(c, jax.devices()[:1])
    temp = exp.lower_step().compile().memory_analysis().temp_size_in_bytes
    return exp.model_cfg.attn_impl, temp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="short sequences, for a smoke test")
    args = parser.parse_args()
    import jax

    lengths = (256, 512, 1024) if args.tiny else (4096, 8192, 16384)
    print(f"jax {jax.__version__}, {platform.processor() or platform.machine()}, 1 cpu device; "
          "compiled ahead of time, nothing allocated")
    print()
    print("| model.attn_impl | runs | " + " | ".join(f"temp MiB at {n}" for n in lengths)
          + f" | {lengths[-1]} / {lengths[0]} |")
    print("|:--|:--|" + "--:|" * (len(lengths) + 1))
    for impl in ("dense", "tiled", "auto"):
        runs, temps = set(), []
        for n in lengths:
            name, temp = temp_bytes(impl, n)
            runs.add(name)
            temps.append(temp)
        cells = " | ".join(f"{t / MiB:.1f}" for t in temps)
        print(f"| {impl} | {'/'.join(sorted(runs))} | {cells} | {temps[-1] / temps[0]:.1f}x |",
              flush=True)


if __name__ == "__main__":
    main()
