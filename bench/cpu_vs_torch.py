"""ndjax against PyTorch + transformers on CPU, side by side, in one run.

The same Llama (vocab 4096, dim 256, 4 layers, 8 heads / 4 kv heads, ffn 688,
untied, float32), the same global batch (8 x 256 tokens), the same AdamW (lr,
betas, eps, weight decay off the norm scales, global-norm clip 1.0), on:

* one device: ndjax on one CPU device; PyTorch in one process,
  ``torch.set_num_threads(cores)``;
* 4 and 8 devices: ndjax with 4 / 8 simulated CPU devices in one process;
  PyTorch with 4 / 8 processes joined by torch.distributed (gloo),
  ``set_num_threads(max(1, cores // world))`` each, using FSDP2 (``fully_shard``)
  for ``fsdp=N`` and DTensor tensor parallelism (``parallelize_module``, q/k/v
  and gate/up column-wise, o and down row-wise) under FSDP2 for
  ``fsdp=N x tensor=2``. Context parallelism is run for ndjax alone: PyTorch's
  ``context_parallel`` is tried, and its error, if any, printed.

Each framework runs in its own worker process (its own thread settings) that
compiles / warms up once, then times ``--steps`` steps whenever the driver asks.
The driver alternates the two frameworks, ``--rounds`` times per layout, and
reports the median of the rounds: a machine that is busy for a while slows both
alike rather than whichever happened to run then. The PyTorch loop is the plain
one (``model(ids).logits`` -> cross-entropy -> backward -> clip -> AdamW step);
its AdamW is ``fused=True`` where it runs (fastest here), else ``foreach``.

    PYTHONPATH=. python bench/cpu_vs_torch.py                 # about 15 minutes on 2 cores
    PYTHONPATH=. python bench/cpu_vs_torch.py --quick         # 1 device and fsdp=4 only
    PYTHONPATH=. python bench/cpu_vs_torch.py --tiny          # smoke run: tiny model, 1 device
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

from ndjax.hardware.host import cpu_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODEL = dict(vocab_size=4096, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688,
             tie_embeddings=False, rope_theta=10_000.0)
TINY_MODEL = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                  tie_embeddings=False, rope_theta=10_000.0)
TRAIN = dict(lr=3e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip_norm=1.0)

# name -> (devices, ndjax mesh, PyTorch plan: (fsdp, tensor) or None, why not)
LAYOUTS = {
    "1 device": (1, dict(fsdp=1), (1, 1)),
    "fsdp=4": (4, dict(fsdp=4), (4, 1)),
    "fsdp=2 x tensor=2": (4, dict(fsdp=2, tensor=2), (2, 2)),
    "fsdp=2 x context=2": (4, dict(fsdp=2, context=2), "context"),
    "fsdp=8": (8, dict(fsdp=8), (8, 1)),
    "fsdp=4 x tensor=2": (8, dict(fsdp=4, tensor=2), (4, 2)),
}
QUICK = ("1 device", "fsdp=4")


def cores() -> int:
    return len(os.sched_getaffinity(0))




def host_batch(vocab: int, batch: int, seq: int, seed: int = 0):
    import numpy as np

    tokens = np.random.default_rng(seed).integers(0, vocab, (batch, seq + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


# ----- workers: build, warm up, then time steps on request ---------------------------------


def serve(run_steps) -> None:
    """Answers the driver: ``steps N`` -> seconds for N steps (and the last loss)."""
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "exit":
            return
        n = int(cmd[1])
        seconds, loss = run_steps(n)
        print("RESULT " + json.dumps(dict(seconds=seconds, loss=loss)), flush=True)


def ndjax_worker(args) -> None:
    devices, mesh, _ = LAYOUTS[args.layout]
    import ndjax  # noqa: F401 -- first: sets up the allocator before jax starts threads
    # isort: split
    import jax

    jax.config.update("jax_num_cpu_devices", devices)

    from ndjax.config import default_config
    from ndjax.experiment import Experiment

    model = json.loads(args.model)
    c = default_config()
    c.model.update(model)
    c.mesh.update(dict(dict(replica=1, fsdp=1, context=1, tensor=1), **mesh))
    c.train.update(dict(batch_size=args.batch, seq_len=args.seq, schedule="constant",
                        warmup_steps=0, steps=10**6, **TRAIN))
    c.data.source = "synthetic"
    serve_experiment(Experiment.from_config(c, jax.devices()[:devices]), args.warmup)


def serve_experiment(exp, warmup: int, extra: dict | None = None) -> None:
    """Compiles ``exp``'s step, warms it up on one fixed batch of random tokens, says
    READY (with the compile time, what runs and ``extra``), then times steps for the
    driver."""
    import numpy as np

    start = time.perf_counter()
    step = exp.compiled_step
    compile_s = time.perf_counter() - start
    t = exp.config.train
    inputs, targets = host_batch(exp.model_cfg.vocab_size, t.batch_size, t.seq_len)
    positions = np.broadcast_to(np.arange(t.seq_len, dtype=np.int32), inputs.shape)
    ones = np.ones(inputs.shape, np.int32)
    batch = exp.device_batch(dict(inputs=inputs, targets=targets, positions=positions,
                                  segment_ids=ones, loss_mask=ones))
    state = [exp.init_state()]

    def run(n):
        start = time.perf_counter()
        for _ in range(n):
            state[0], metrics = step(state[0], batch)
        loss = float(metrics["loss"])  # waits for the last step
        return time.perf_counter() - start, loss

    run(warmup)
    print("READY " + json.dumps(dict(compile_s=compile_s, attention=exp.model_cfg.attn_impl,
                                     scan_layers=exp.model_cfg.scan_layers, **(extra or {}))),
          flush=True)
    serve(run)


def _torch_model(model: dict, seq: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=model["vocab_size"], hidden_size=model["dim"],
                      intermediate_size=model["ffn_dim"], num_hidden_layers=model["n_layers"],
                      num_attention_heads=model["n_heads"],
                      num_key_value_heads=model["n_kv_heads"], max_position_embeddings=seq,
                      rope_theta=model["rope_theta"], rms_norm_eps=1e-5,
                      tie_word_embeddings=model["tie_embeddings"], attention_bias=False,
                      mlp_bias=False, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def _mesh_of(t):
    return getattr(t, "device_mesh", None)


def _param_groups(model):
    """Decayed and not (the norm scales), each split by DTensor mesh: under FSDP2 x TP
    the split weights live on the 2-D mesh and the rest on the 1-D one, and one
    fused/foreach call cannot mix them."""
    groups: dict = {}
    for name, p in model.named_parameters():
        decay = "norm" not in name
        groups.setdefault((decay, id(_mesh_of(p))), dict(
            params=[], weight_decay=TRAIN["weight_decay"] if decay else 0.0))["params"].append(p)
    return list(groups.values())


def _adamw(model):
    import torch

    kwargs = dict(lr=TRAIN["lr"], betas=(TRAIN["b1"], TRAIN["b2"]), eps=TRAIN["eps"])
    try:
        return torch.optim.AdamW(_param_groups(model), fused=True, **kwargs), "fused"
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(_param_groups(model), foreach=True, **kwargs), "foreach"


def _clip(params, max_norm: float):
    """Global-norm clipping that also works when the gradients are DTensors on
    different meshes (FSDP2 x TP): each mesh's group is reduced, and scaled, alone."""
    import torch
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(id(_mesh_of(p)), []).append(p)
    squares = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], 2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm ** 2)
    total = torch.stack(squares).sum().sqrt()
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)


def torch_rank(rank: int, world: int, args, commands, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, cores() // world))
    model_dims = json.loads(args.model)
    plan = LAYOUTS[args.layout][2]
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = _torch_model(model_dims, args.seq)
    inputs, targets = (torch.from_numpy(a).long() for a in host_batch(
        model_dims["vocab_size"], args.batch, args.seq))
    cp_context = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if plan == "context":
            from torch.distributed.tensor.experimental import context_parallel

            mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "cp"))
            rows = args.batch // (world // 2)
            dp_rank = mesh["dp"].get_local_rank()
            inputs, targets = (a[dp_rank * rows:(dp_rank + 1) * rows].contiguous()
                               for a in (inputs, targets))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh["dp", "cp"]._flatten("dp_cp"))
            fully_shard(model, mesh=mesh["dp", "cp"]._flatten("dp_cp"))
            cp_context = lambda: context_parallel(  # noqa: E731
                mesh["cp"], buffers=[inputs, targets], buffer_seq_dims=[1, 1])
        else:
            fsdp, tensor = plan
            if tensor > 1:
                from torch.distributed.tensor.parallel import (
                    ColwiseParallel,
                    RowwiseParallel,
                    parallelize_module,
                )

                mesh = init_device_mesh("cpu", (fsdp, tensor), mesh_dim_names=("dp", "tp"))
                dp_mesh = mesh["dp"]
                layer_plan = {"self_attn.q_proj": ColwiseParallel(),
                              "self_attn.k_proj": ColwiseParallel(),
                              "self_attn.v_proj": ColwiseParallel(),
                              "self_attn.o_proj": RowwiseParallel(),
                              "mlp.gate_proj": ColwiseParallel(),
                              "mlp.up_proj": ColwiseParallel(),
                              "mlp.down_proj": RowwiseParallel()}
                for layer in model.model.layers:
                    parallelize_module(layer, mesh["tp"], layer_plan)
            else:
                dp_mesh = init_device_mesh("cpu", (fsdp,), mesh_dim_names=("dp",))
            rows = args.batch // fsdp
            dp_rank = dp_mesh.get_local_rank()
            inputs, targets = (a[dp_rank * rows:(dp_rank + 1) * rows].contiguous()
                               for a in (inputs, targets))
            for layer in model.model.layers:
                fully_shard(layer, mesh=dp_mesh)
            fully_shard(model, mesh=dp_mesh)
    optimizer, kind = _adamw(model)
    params = [p for p in model.parameters()]
    vocab = model_dims["vocab_size"]

    def one_step():
        if cp_context is not None:
            with cp_context():
                logits = model(input_ids=inputs).logits
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab).float(),
                                                         targets.reshape(-1))
                loss.backward()
        else:
            logits = model(input_ids=inputs).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab).float(),
                                                     targets.reshape(-1))
            loss.backward()
        _clip(params, TRAIN["clip_norm"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    def run(n):
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            loss = one_step()
        loss = loss.detach()
        if world > 1:
            dist.all_reduce(loss)
            loss = loss / world
            dist.barrier()
        return time.perf_counter() - start, float(loss)

    for _ in range(args.warmup):
        one_step()
    if rank == 0:
        results.put(("READY", dict(optimizer=kind)))
    while True:
        n = torch.zeros((), dtype=torch.int64)
        if rank == 0:
            n += commands.get()
        if world > 1:
            dist.broadcast(n, 0)
        if int(n) == 0:
            break
        out = run(int(n))
        if rank == 0:
            results.put(("RESULT", out))
    if world > 1:
        dist.destroy_process_group()


def _torch_rank_main(rank, world, args, commands, results):
    try:
        torch_rank(rank, world, args, commands, results)
    except Exception as e:  # noqa: BLE001 -- reported to the driver as "cannot run"
        if rank == 0:
            results.put(("ERROR", f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"))
        raise


def torch_worker(args) -> None:
    import torch.multiprocessing as mp

    devices, _, plan = LAYOUTS[args.layout]
    world = devices
    ctx = mp.get_context("spawn")
    commands, results = ctx.Queue(), ctx.Queue()
    if world == 1:
        import threading

        thread = threading.Thread(target=_torch_rank_main, args=(0, 1, args, commands, results),
                                  daemon=True)
        thread.start()
        procs = [thread]  # joined below, before the queues close under it
    else:
        procs = [ctx.Process(target=_torch_rank_main, args=(r, world, args, commands, results),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
    kind, payload = results.get()
    if kind == "ERROR":
        print("ERROR " + payload, flush=True)
        for p in procs:
            if hasattr(p, "kill"):
                p.kill()
        return
    print("READY " + json.dumps(payload), flush=True)

    def run(n):
        commands.put(n)
        kind, out = results.get()
        if kind == "ERROR":
            raise RuntimeError(out)
        return out

    serve(run)
    commands.put(0)
    for p in procs:
        p.join(timeout=30)


# ----- driver ------------------------------------------------------------------------------


class Worker:
    """A worker process (``script argv``) that says READY, then times steps on request."""

    def __init__(self, argv: list[str], script: str = __file__):
        cmd = [sys.executable, os.path.abspath(script), *argv]
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env, cwd=ROOT)
        self.info = self.error = None

    def wait_ready(self):
        self.info, self.error = self._read("READY")

    def _read(self, tag):
        for line in self.proc.stdout:
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1:]), None
            if line.startswith("ERROR "):
                return None, line[6:].strip()
        return None, f"worker exited with status {self.proc.wait()}"

    def time(self, steps: int):
        self.proc.stdin.write(f"steps {steps}\n")
        self.proc.stdin.flush()
        out, error = self._read("RESULT")
        if error:
            raise RuntimeError(error)
        return out

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("exit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()


def measure(layout: str, args, port: int) -> dict:
    tokens = args.batch * args.seq * args.steps
    row = dict(layout=layout, ndjax=[], torch=[], note="")
    # Both start (import, compile, warm up) at once; only the timed rounds alternate.
    nd, th = (Worker(["--worker", framework, "--layout", layout,
                      "--model", json.dumps(args.model_dims), "--batch", str(args.batch),
                      "--seq", str(args.seq), "--warmup", str(args.warmup),
                      "--port", str(port + i)])
              for i, framework in enumerate(("ndjax", "torch")))
    try:
        nd.wait_ready()
        th.wait_ready()
        if nd.error:
            row["note"] = f"ndjax: {nd.error}"
        if th.error:
            row["note"] = f"PyTorch cannot run this layout on CPU here ({th.error})"
        for _ in range(args.rounds):
            for name, worker in (("ndjax", nd), ("torch", th)):
                if worker.error is None:
                    out = worker.time(args.steps)
                    row[name].append(tokens / out["seconds"])
                    row[name + "_loss"] = out["loss"]
        row["ndjax_info"], row["torch_info"] = nd.info, th.info
    finally:
        nd.close()
        th.close()
    return row


def fmt(rates):
    return f"{statistics.median(rates):,.0f}" if rates else "-"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="alternations per layout")
    p.add_argument("--steps", type=int, default=5, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after compiling")
    p.add_argument("--layouts", default="", help="comma-separated names (default: all)")
    p.add_argument("--quick", action="store_true", help="1 device and fsdp=4, 3 rounds")
    p.add_argument("--tiny", action="store_true", help="smoke run: tiny model, 1 round")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    # worker-only
    p.add_argument("--worker", choices=("ndjax", "torch"), help=argparse.SUPPRESS)
    p.add_argument("--layout", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=29500, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker == "ndjax":
        return ndjax_worker(args)
    if args.worker == "torch":
        return torch_worker(args)
    # Here, not at the top: the torch worker must not import ndjax (its allocator set-up).
    from ndjax.runtime.children import stop_children_on_signals

    stop_children_on_signals()  # a stopped run stops both workers and PyTorch's ranks

    layouts = list(LAYOUTS)
    if args.layouts:
        layouts = [name.strip() for name in args.layouts.split(",")]
        unknown = [n for n in layouts if n not in LAYOUTS]
        if unknown:
            p.error(f"unknown layouts {unknown}; choose from {list(LAYOUTS)}")
    elif args.tiny:
        layouts = ["1 device"]
    elif args.quick:
        layouts = list(QUICK)
    if args.quick:
        args.rounds = min(args.rounds, 3)
    if args.tiny:
        args.rounds, args.steps, args.warmup, args.seq = 1, 1, 1, 64
    args.model_dims = TINY_MODEL if args.tiny else MODEL

    import jax
    import torch

    load = os.getloadavg()[0]
    print(f"# CPU: ndjax vs PyTorch, {datetime.datetime.now():%Y-%m-%d %H:%M}, {cpu_model()}, "
          f"{cores()} cores; jax {jax.__version__}, torch {torch.__version__}")
    print(f"model {args.model_dims}, float32, global batch {args.batch} x {args.seq}; "
          f"{args.rounds} rounds x {args.steps} steps after {args.warmup} warm-up steps, "
          "frameworks alternating; tokens/s = median over rounds\n")
    rows = []
    for i, layout in enumerate(layouts):
        rows.append(measure(layout, args, port=29500 + 10 * i))
        r = rows[-1]
        print(f"  {layout}: ndjax {[round(x) for x in r['ndjax']]}, "
              f"torch {[round(x) for x in r['torch']]}", file=sys.stderr, flush=True)
    # Other work on the machine slows both frameworks, PyTorch's OpenMP threads the most
    # (they spin at every parallel region's barrier): a figure taken on a busy machine is
    # no measure of either, and the ratio is not either.
    print(f"load average (1 min) at start {load:.1f}, at end {os.getloadavg()[0]:.1f} on "
          f"{cores()} cores; above ~0.5 per core other work was running\n")
    print("| layout | devices | ndjax tokens/s | PyTorch tokens/s | ndjax / PyTorch | "
          "PyTorch runs as | note |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        devices, _, plan = LAYOUTS[r["layout"]]
        ratio = (f"{statistics.median(r['ndjax']) / statistics.median(r['torch']):.2f}x"
                 if r["ndjax"] and r["torch"] else "-")
        if plan == "context":
            how = f"context_parallel, {devices} processes"
        elif devices == 1:
            how = f"1 process, {cores()} threads"
        else:
            how = (f"FSDP2{' + TP' if plan[1] > 1 else ''}, {devices} processes x "
                   f"{max(1, cores() // devices)} thread")
        if r.get("torch_info"):
            how += f", AdamW {r['torch_info']['optimizer']}"
        print(f"| {r['layout']} | {devices} | {fmt(r['ndjax'])} | {fmt(r['torch'])} | {ratio} | "
              f"{how} | {r['note']} |")


if __name__ == "__main__":
    main()
