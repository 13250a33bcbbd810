"""Train-step memory against the sequence length, attention kernel by kernel.

Compiles the train step ahead of time on one CPU device (nothing is allocated or
run) for the ``tiny`` preset cut to one layer, batch 1, float32, remat none, and
reads ``compiled.memory_analysis().temp_size_in_bytes``, for ``dense``, ``tiled``
and what ``auto`` picks, at each sequence length. Linear memory means 4x the
tokens cost about 4x the bytes; dense attention's (seq x seq) scores cost 16x.

    PYTHONPATH=. python bench/attention_memory.py           # 4096, 8192, 16384 tokens
    PYTHONPATH=. python bench/attention_memory.py --tiny    # smoke run, seconds
    PYTHONPATH=. python bench/attention_memory.py --compile_for=h100   # GPU kernels, no GPU

``--compile_for`` (the gpu-compile extra): one Llama 3 8B attention layer's gradient
(batch 1, 32 query heads, 8 kv heads, head_dim 128, bfloat16) compiled by XLA's GPU
compiler for that GPU, each GPU kernel at 4096 and 16384 tokens: ``cudnn`` with
room for ``model.attn_max_docs`` documents per row (64, the default) and, as before
that bound existed, for one per token; jax's plain causal cuDNN attention (no
packed documents) as the floor; ``pallas``; ``tiled``.
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


def gpu_layer(hardware: str) -> None:
    """One layer's attention gradient per GPU kernel, compiled for ``hardware``."""
    import os
    import types

    os.environ["JAX_PLATFORMS"] = "cpu"
    from ndjax.runtime.console import native_stderr

    with native_stderr():
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        from ndjax.hardware import gpu_target
        from ndjax.ops import attention as attn

        hw = gpu_target.hardware(hardware)
        devices = gpu_target.devices(hw, 1)
    replicated = NamedSharding(Mesh(np.array(devices), ("x",)), PartitionSpec())

    def temp(kernel, seq: int) -> float:
        q = jax.ShapeDtypeStruct((1, seq, 32, 128), jnp.bfloat16, sharding=replicated)
        k = jax.ShapeDtypeStruct((1, seq, 8, 128), jnp.bfloat16, sharding=replicated)
        seg = jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=replicated)
        grad = jax.grad(lambda q, k, v, s: kernel(q, k, v, s).astype(jnp.float32).sum(),
                        argnums=(0, 1, 2))
        with gpu_target.compiling_for(devices), native_stderr():
            compiled = jax.jit(grad).trace(q, k, k, seg).lower().compile()
        return compiled.memory_analysis().temp_size_in_bytes

    def cudnn(max_docs):
        def run(q, k, v, seg):
            cfg = types.SimpleNamespace(attn_max_docs=max_docs or q.shape[1])
            return attn.KERNELS["cudnn"](q, k, v, seg, cfg)
        return run

    kernels = {
        "cudnn, room for 64 documents (model.attn_max_docs=64)": cudnn(64),
        "cudnn, room for one document per token (before the bound)": cudnn(None),
        "plain causal cuDNN (jax.nn.dot_product_attention, no documents)":
            lambda q, k, v, s: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                            implementation="cudnn"),
        "pallas": lambda q, k, v, s: attn.pallas_attention(q, k, v, s),
        "tiled": lambda q, k, v, s: attn.KERNELS["tiled"](
            q, k, v, s, types.SimpleNamespace(attn_kv_tile=512)),
    }
    lengths = (4096, 16384)
    print(f"jax {jax.__version__}; compiled for {hw.name} by XLA's GPU compiler on a CPU "
          "machine; one layer's attention gradient, batch 1, 32 heads / 8 kv heads, "
          "head_dim 128, bfloat16")
    print()
    print("| kernel | " + " | ".join(f"temp MiB at {n}" for n in lengths)
          + f" | {lengths[-1]} / {lengths[0]} |")
    print("|:--|" + "--:|" * (len(lengths) + 1))
    for name, kernel in kernels.items():
        temps = [temp(kernel, n) for n in lengths]
        print(f"| {name} | " + " | ".join(f"{t / MiB:,.1f}" for t in temps)
              + f" | {temps[-1] / temps[0]:.1f}x |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="short sequences, for a smoke test")
    parser.add_argument("--compile_for", default=None, metavar="HARDWARE",
                        help="one layer of each GPU kernel, compiled for this GPU (h100, ...)")
    args = parser.parse_args()
    if args.compile_for:
        gpu_layer(args.compile_for)
        return
    import jax

    lengths = (256, 512) if args.tiny else (4096, 8192, 16384)
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
