"""Per-device memory of the compiled train step, by compute dtype, remat and storage dtypes.

Compiles the real train step ahead of time on simulated CPU devices (nothing is
allocated or run) and reads ``compiled.memory_analysis()``: arguments (parameters,
optimizer state, batch) and temporaries (activations kept for the backward pass,
gradients, collective buffers) per device. Shapes:

* ``d512``: vocab 2048, dim 512, 8 layers, fsdp=8, batch 8 x 64: weights dominate, so a
  kept copy of the gathered model shows.
* ``tiny``: the ``tiny`` preset (vocab 2048, dim 256, 8 layers), fsdp=8, batch 8 x 2048.
* ``1b``: ``llama3_1b`` (vocab 128256, dim 2048, 16 layers, tied), fsdp=8, batch 8 x 4096.
* ``70b``: ``llama3_70b``, fsdp=8 x tensor=8 on 64 devices, batch 8 x 4096, bf16, remat=full,
  rules ``default`` vs ``megatron_sp``, against the bound of full remat: each layer's
  bfloat16 input (layers x rows x seq x dim x 2 bytes per device) plus the float32
  gradients (sharded like the parameters).

Attention is the dense kernel on one context shard (its (seq x seq) scores dominate
every policy's working set at 4096 tokens), and for comparison the tiled kernel
(``model.attn_impl=tiled``), whose memory is linear in the sequence; 70B runs what
``auto`` picks. The CPU
compiler widens some bfloat16 buffers to float32, so bf16 figures other than
remat=full's saved inputs are upper bounds of a GPU's.

    PYTHONPATH=. python bench/memory.py            # all shapes (about 3 minutes)
    PYTHONPATH=. python bench/memory.py --tiny     # smoke run, seconds
"""

from __future__ import annotations

import argparse
import math
import platform
import time

MiB = 2**20


def _rows(tiny: bool):
    dtypes = [("float32", {}), ("bfloat16", {})]
    remats = ["none", "save_proj", "full"]
    shapes = {
        # The shape issue 13's FSDP defect was measured on (bf16 kept a gathered copy).
        "d512": (dict(preset="tiny", vocab_size=2048, dim=512, n_layers=8, ffn_dim=1024),
                 dict(fsdp=8), dict(batch_size=8, seq_len=64), 8),
        "tiny": (dict(preset="tiny"), dict(fsdp=8), dict(batch_size=8, seq_len=2048), 8),
        "1b": (dict(preset="llama3_1b"), dict(fsdp=8), dict(batch_size=8, seq_len=4096), 8),
    }
    if tiny:
        shapes = {"smoke": (dict(preset="tiny", n_layers=2, vocab_size=512), dict(fsdp=8),
                            dict(batch_size=8, seq_len=64), 8)}
        # One row of each kind (the suite's smoke test: each row is a compile).
        dtypes, remats = dtypes[1:], ["none", "full"]
    for shape, (model, mesh, train, devices) in shapes.items():
        for dtype, extra in dtypes:
            for remat in remats:
                yield shape, dict(model, dtype=dtype, remat=remat, **extra), mesh, train, \
                    "default", devices
        for remat in ("none", "full")[:1 if tiny else 2]:
            yield shape, dict(model, dtype="bfloat16", remat=remat, param_dtype="bfloat16"), \
                mesh, dict(train, opt_state_dtype="bfloat16"), "default", devices
        # Without the dense (seq x seq) scores: the tiled kernel.
        for remat in ("none", "save_proj", "full")[2 if tiny else 0:]:
            yield shape, dict(model, dtype="bfloat16", remat=remat, attn_impl="tiled"), \
                mesh, train, "default", devices
    if not tiny:
        for rules in ("default", "megatron_sp"):
            yield "70b", dict(preset="llama3_70b", dtype="bfloat16", remat="full",
                              attn_impl="auto"), \
                dict(fsdp=8, tensor=8), dict(batch_size=8, seq_len=4096), rules, 64


def measure(model, mesh, train, rules, devices):
    import jax

    from ndjax.config import default_config
    from ndjax.experiment import Experiment

    c = default_config()
    c.model.update({"attn_impl": "dense", **model})
    c.mesh.update(dict(dict(replica=1, fsdp=1, context=1, tensor=1), **mesh))
    c.train.update(train)
    c.rules = rules
    c.data.source = "synthetic"
    t0 = time.perf_counter()
    exp = Experiment.from_config(c, jax.devices()[:devices])
    m = exp.compiled_step.memory_analysis()
    seconds = time.perf_counter() - t0
    return exp, m.argument_size_in_bytes, m.temp_size_in_bytes, seconds


def full_remat_bound(exp) -> float:
    """Layers x local rows x local seq x dim x 2 bytes + float32 gradients per device."""
    import jax

    cfg, t = exp.model_cfg, exp.config.train
    rows = t.batch_size // math.prod(exp.mesh.shape[a] for a in exp.rules.axes_of("act_batch"))
    seq = t.seq_len // math.prod(exp.mesh.shape[a] for a in exp.rules.axes_of("act_res_seq"))
    inputs = cfg.n_layers * rows * seq * cfg.dim * 2
    grads = sum(math.prod(sh.shard_shape(s.shape)) * 4 for s, sh in zip(
        jax.tree.leaves(exp.param_shapes), jax.tree.leaves(exp.state_sharding.params)))
    return inputs + grads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="one small shape, for a smoke test")
    args = parser.parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", 8 if args.tiny else 64)
    from ndjax.config import default_config

    known = default_config()
    print(f"jax {jax.__version__}, {platform.processor() or platform.machine()}, "
          f"simulated cpu devices; compiled ahead of time, nothing allocated")
    print()
    print("| shape | layout | rules | attention | compute | params | moments | remat | "
          "arguments MiB | temp MiB | total MiB | full-remat bound MiB | compile s |")
    print("|:--|:--|:--|:--|:--|:--|:--|:--|--:|--:|--:|--:|--:|")
    for shape, model, mesh, train, rules, devices in _rows(args.tiny):
        if any(k not in known.model for k in model) or any(k not in known.train for k in train):
            continue  # a field this checkout does not have (e.g. an older commit)
        exp, arg, temp, seconds = measure(model, mesh, train, rules, devices)
        bound = f"{full_remat_bound(exp) / MiB:.0f}" if model["remat"] == "full" else "-"
        layout = " x ".join(f"{k}={v}" for k, v in mesh.items())
        attention = exp.model_cfg.attn_impl
        print(f"| {shape} | {layout} | {rules} | {attention} | {model['dtype']} | "
              f"{model.get('param_dtype', 'float32')} | "
              f"{train.get('opt_state_dtype', 'float32')} | {model['remat']} | "
              f"{arg / MiB:.1f} | {temp / MiB:.1f} | {(arg + temp) / MiB:.1f} | {bound} | "
              f"{seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
