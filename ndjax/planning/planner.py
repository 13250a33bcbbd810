"""Every mesh for N GPUs, checked, compiled ahead of time and priced (``ndjax plan``).

For one config and N devices:

1. ``layouts``: every factorisation of N into stage x replica x fsdp x expert x
   context x tensor (stages where asked for, ``stage_degrees``: whole nodes each;
   experts for a mixture of experts), under each rule preset (or the config's own
   table), with the config's ``model.remat`` and ``train.grad_accum`` (and with
   stages, ``microbatches``).
2. ``check``: ``Experiment.from_config`` on the N devices compiled for, the checks a
   train.py run makes, with the target's dtypes (``model.dtype=auto`` is
   bfloat16 on GPUs). A layout that fails one is *rejected* with that one-line
   reason. Layouts that compile to the same program on the same devices
   (``megatron_sp`` without a tensor axis; ``zero3_everywhere`` on replica=2 x
   fsdp=4 is ``default`` on fsdp=8) are compiled once, as aliases of one another.
   The attention kernel is the one ``auto`` (or the config) picks on the target
   GPU; on CPU devices a fused GPU kernel (cudnn, pallas) is compiled as ``tiled``,
   the CPU kernel with the same memory class (linear in the sequence).
3. ``measure``: the real train step lowered against abstract inputs and compiled
   (nothing is allocated): by XLA's GPU compiler for N GPUs of the target kind
   where the gpu-compile extra is installed (``ndjax.hardware.gpu_target``; the fused
   kernels compiled for real, with the train step's GPU options), else on N
   simulated CPU devices, in worker processes; from the compiled module: argument
   and temporary bytes per device (``memory_analysis``), every collective
   (``ndjax.parallel.collectives``) and the partitioner's involuntary rematerialisations.
   A layout whose inputs alone (parameters, optimizer state, batch: known from
   their shardings) overflow the budget is not compiled. Results are cached on
   disk, keyed by the config, N, the compiler, the jax version and ndjax's source.
4. A layout over the memory budget whose parameters, optimizer state and batch
   fit is retried with more rematerialisation (``none`` -> ``save_proj`` -> ``full``)
   and then gradient accumulation (x2, x4, ...), until it fits or nothing is left.
   With ``top`` (``_search``) the layouts and their retries compile from one queue,
   best first by a lower bound of their step time: a layout's from its compute and
   the traffic its shardings force (``Checked.least_step_s``,
   ``ndjax.planning.traffic_bound``), a retry's from the communication measured at
   less remat and its own compute (more remat adds compute and never removes a
   collective). Once the lowest bound left cannot beat the ``top``-th best that
   fits, nothing more is compiled: a layout left is ``slower``, a retry left says
   it could not rank.
5. ``ndjax.hardware.roofline`` turns FLOPs and collectives into a step time on the target
   hardware; fitting layouts are ranked by it (no-overlap figure). With stages the
   compute is what the devices run (``executed_flops``: GPipe's bubble and the LM head
   on every stage), the stage sends are the compiled step's collective permutes.

The CPU compiler is a stand-in for the GPU one: memory figures are XLA's CPU
buffer plan for the same program (the CPU widens bf16 buffers and lowers
reduce-scatter as all-reduce, so temporaries run high: BENCHMARKS.md, "Compiled
for GPUs"), and collective bytes are the program's, which a GPU compile shares.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import math
import multiprocessing
import os
import re
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import jax
import ml_collections

from ndjax.config import Settings, as_settings, default_config
from ndjax.hardware import roofline
from ndjax.models import decoder
from ndjax.parallel import pipeline, platforms
from ndjax.parallel import rules as rules_lib
from ndjax.parallel.collectives import collectives
from ndjax.parallel.mesh import AXES
from ndjax.parallel.rules import PRESETS
from ndjax.planning import traffic_bound
from ndjax.runtime import children, compiler
from ndjax.runtime.errors import ConfigError

CONFIG_RULES = "config"          # the config's own rule table (not a preset name)
REMAT_LADDER = ("none", "save_proj", "full")
# Where the GPU compiler measures, one rung more: the layer inputs in host memory
# (a CPU compile keeps them in its one memory, so it would measure full's bytes).
OFFLOAD = "offload"
# Context parallelism's algorithms, each planned where the config leaves it to auto.
CP_ALGORITHMS = ("ring", "all_to_all")
# The planner reads the compiled module's buffers and collectives, never runs it:
# LLVM's optimisations of the CPU code change neither and take most of the time
# (the tiny step: 11.0 s -> 2.9 s, the same bytes and collectives); so do the fusion
# emitters where jax 0.10's older ones are there to take instead (compiler.CPU_QUICK_OPTIONS).
MEASURE_OPTIONS = compiler.CPU_QUICK_OPTIONS


@dataclasses.dataclass(frozen=True)
class Layout:
    replica: int
    fsdp: int
    context: int
    tensor: int
    rules: str = "default"
    remat: str = "none"
    grad_accum: int = 1
    cp_impl: str = "auto"        # model.cp_impl: how context shards meet (context > 1)
    expert: int = 1              # mesh.expert (positional calls name the other four)
    stage: int = 1               # mesh.stage: pipeline stages
    microbatches: int = 0        # train.microbatches, with stage > 1 (GPipe's micro-batches)
    virtual_stages: int = 1      # mesh.virtual_stages, with stage > 1 (circular where > 1)
    pipeline_schedule: str = "gpipe"  # mesh.pipeline_schedule, with stage > 1

    @property
    def degrees(self) -> tuple[int, ...]:
        """In ``AXES``' order."""
        return tuple(getattr(self, a) for a in AXES)

    @property
    def mesh(self) -> str:
        return " x ".join(f"{a}={s}" for a, s in zip(AXES, self.degrees) if s > 1) or "1 device"

    @property
    def settings(self) -> str:
        """The rule table, the CP algorithm where the sequence is split, and the
        micro-batches where the layers are."""
        return (self.rules + (f", {self.cp_impl}" if self.context > 1 else "")
                + (f", {self.microbatches} micro-batches" if self.stage > 1 else "")
                + (f", {self.virtual_stages} chunks a stage" if self.stage > 1
                   and self.virtual_stages > 1 else "")
                + (", 1F1B" if self.stage > 1 and self.pipeline_schedule == "1f1b" else ""))

    @property
    def schedule(self) -> pipeline.GPipe | None:
        """The pipeline's schedule (None without stages)."""
        return (pipeline.schedule(self.stage, self.microbatches, self.virtual_stages,
                                  self.pipeline_schedule) if self.stage > 1 else None)

    def with_(self, **changes: Any) -> Layout:
        return dataclasses.replace(self, **changes)


def factorizations(n: int, experts: int = 0, stages: Sequence[int] = (1,)
                   ) -> list[tuple[int, ...]]:
    """Degrees in ``AXES``' order (stage, replica, fsdp, expert, context, tensor) with product
    n, tensor, context and expert first growing (the usual reading order of a plan).
    ``expert`` > 1 only for a mixture of ``experts`` experts, dividing them; ``stage``
    one of ``stages`` (``stage_degrees``)."""
    out = []
    for s in stages:
        if n % s:
            continue
        rest = n // s
        divisors = [d for d in range(1, rest + 1) if rest % d == 0]
        splits = [e for e in divisors if e == 1 or (experts and experts % e == 0)]
        for e in splits:
            for t in divisors:
                for c in divisors:
                    for f in divisors:
                        if rest % (e * t * c * f) == 0:
                            out.append((s, rest // (e * t * c * f), f, e, c, t))
    return out


def stage_degrees(n: int, staged_layers: int, devices_per_node: int) -> list[int]:
    """The pipeline stage counts planned: 1, and each count >= 2 that divides the layers
    the stages cut and gives every stage whole nodes (n / stage a multiple of
    ``devices_per_node``). Stages are for the slow links: inside a node, FSDP's and
    tensor parallelism's collectives run over NVLink, and a pipeline would only add
    its bubble."""
    out = [1]
    for s in range(2, n + 1):
        if n % s == 0 and staged_layers % s == 0 and (n // s) % devices_per_node == 0:
            out.append(s)
    return out


def microbatches(config: ml_collections.ConfigDict | Settings, layout: Layout) -> int:
    """GPipe's micro-batches for a layout with stages: the config's
    ``train.microbatches`` where set; else the most, up to 4 per stage, that split each
    grad_accum slice's rows evenly over the axes that split the batch. More shrink the
    bubble, (S - 1) / (M + S - 1), 20% at 4 per stage; each adds a tick of weight
    gathers and smaller matmuls, which the roofline does not price."""
    s = as_settings(config)
    if layout.stage == 1:
        return 0
    if s.train.microbatches:
        return s.train.microbatches
    table = s.rules if layout.rules == CONFIG_RULES else layout.rules
    axes = dict(rules_lib.get_table(table)).get("act_batch")
    degrees = dict(zip(AXES, layout.degrees))
    data = math.prod(degrees[a] for a in rules_lib.axes_of(axes))
    rows = s.train.batch_size // layout.grad_accum // data
    fits = [m for m in range(1, 4 * layout.stage + 1) if rows and rows % m == 0]
    return fits[-1] if fits else layout.stage  # none: the check says why


def layouts(config: ml_collections.ConfigDict, n: int,
            presets: Sequence[str] | None = None, devices_per_node: int = 8,
            stages: Sequence[int] | None = ()) -> list[Layout]:
    """Every candidate: degrees x rule tables, with the config's remat and grad_accum;
    with context > 1 and ``model.cp_impl=auto``, once per CP algorithm, side by side
    (the ring and all-to-all trade memory, bytes and kernels by shape: let the
    figures choose). ``stages``: the pipeline stage counts besides 1 (None: every
    count ``stage_degrees`` gives), each layout with its ``microbatches``."""
    if isinstance(config.rules, str):
        tables = list(presets) if presets else list(PRESETS)
    else:
        tables = [CONFIG_RULES]
    cp = config.model.cp_impl
    experts, staged = _model_counts(config)
    if stages is None:
        stages = stage_degrees(n, staged, devices_per_node) if staged else [1]
    out = []
    for degrees in factorizations(n, experts, sorted({1, *stages})):
        mesh = dict(zip(AXES, degrees))
        for rules in tables:
            for algorithm in (CP_ALGORITHMS if mesh["context"] > 1 and cp == "auto"
                              else (cp,)):
                layout = Layout(**mesh, rules=rules, remat=config.model.remat,
                                grad_accum=config.train.grad_accum, cp_impl=algorithm)
                staged = mesh["stage"] > 1
                out.append(layout.with_(
                    microbatches=microbatches(config, layout),
                    virtual_stages=getattr(config.mesh, "virtual_stages", 1) if staged else 1,
                    pipeline_schedule=getattr(config.mesh, "pipeline_schedule", "gpipe")
                    if staged else "gpipe"))
    return out


def _model_counts(config: ml_collections.ConfigDict) -> tuple[int, int]:
    """The model's experts (0: dense) and the layers pipeline stages cut (DeepSeek V3's
    dense first layers run before them), as ``Experiment`` reads them; (0, 0) where the
    config does not check (each layout's check then says why)."""
    from ndjax.experiment import check_fields

    try:
        cfg = check_fields(config)[1]
    except ConfigError:
        return 0, 0
    return cfg.n_experts, cfg.n_layers - cfg.first_k_dense


def layout_settings(config: ml_collections.ConfigDict | Settings, layout: Layout) -> Settings:
    """The settings with one layout's fields (degrees, rules, remat, CP algorithm,
    accumulation, micro-batches; mesh.auto off), the rest as given (a new object)."""
    s = as_settings(config)
    return dataclasses.replace(
        s, model=dataclasses.replace(s.model, remat=layout.remat, cp_impl=layout.cp_impl),
        mesh=dataclasses.replace(s.mesh, auto=False, virtual_stages=layout.virtual_stages,
                                 pipeline_schedule=layout.pipeline_schedule,
                                 **dict(zip(AXES, layout.degrees))),
        train=dataclasses.replace(s.train, grad_accum=layout.grad_accum,
                                  microbatches=layout.microbatches or s.train.microbatches),
        rules=s.rules if layout.rules == CONFIG_RULES else layout.rules)


def target_settings(config: ml_collections.ConfigDict | Settings, layout: Layout,
                    attn_impl: str | None = None) -> Settings:
    """``layout_settings`` in the target's dtypes and with what a GPU runs (a new object:
    the config given is not changed)."""
    s = layout_settings(config, layout)
    return dataclasses.replace(s, model=dataclasses.replace(
        s.model, dtype="bfloat16" if s.model.dtype == "auto" else s.model.dtype,
        # What a GPU runs (decoder.default_scan_layers).
        scan_layers=True if s.model.scan_layers is None else s.model.scan_layers,
        attn_impl=s.model.attn_impl if attn_impl is None else attn_impl))


def target_config(config: ml_collections.ConfigDict | Settings, layout: Layout,
                  attn_impl: str | None = None) -> ml_collections.ConfigDict:
    """``target_settings`` as a config (what a worker process is sent)."""
    return ml_collections.ConfigDict(target_settings(config, layout, attn_impl).to_dict())


@dataclasses.dataclass
class Checked:
    """A layout that passed every check: the settings to compile and what it runs."""

    layout: Layout
    settings: Settings
    attention: str           # the kernel on the GPU, and what stands in for it here
    model_flops: float       # training FLOPs of one step, all devices
    tokens: int
    signature: tuple
    # Bytes per device of the step's inputs (parameters, optimizer state, batch),
    # from their shardings: what the compiled step's arguments will be.
    arguments: int = 0
    # What the layout's remat reruns in the backward pass, FLOPs of one step, all devices.
    recompute_flops: float = 0.0
    # The least traffic its step can have, from its shardings (ndjax.planning.traffic_bound).
    least_link: roofline.Link | None = None
    # What its devices compute in one step, all devices (``executed_flops``).
    executed_flops: float | None = None

    def least_step_s(self, hardware: roofline.Hardware) -> float:
        """A lower bound of its step time: its compute, and its least traffic."""
        if self.least_link is None:
            return 0.0
        return self.estimate(hardware, self.least_link).serial_s

    def estimate(self, hardware: roofline.Hardware, link: roofline.Link,
                 host_bytes: float = 0.0) -> roofline.Estimate:
        """Its roofline step time with ``link``'s traffic."""
        return roofline.estimate(hardware, link, self.model_flops, self.tokens,
                                 math.prod(self.layout.degrees), self.layout.remat,
                                 self.recompute_flops, host_bytes, self.executed_flops)

    @property
    def config(self) -> ml_collections.ConfigDict:
        """The settings as a config (what a worker process is sent)."""
        return ml_collections.ConfigDict(self.settings.to_dict())


def check(config: ml_collections.ConfigDict | Settings, layout: Layout,
          devices: Sequence[jax.Device], hardware: roofline.Hardware,
          inputs: Any = None, devices_per_node: int = 8) -> Checked:
    """``Experiment.from_config``'s checks for this layout; ConfigError if one fails.
    ``inputs`` (``experiment.Inputs``): the checkpoint and data, checked once for all
    layouts (None: checked here)."""
    from ndjax.experiment import Experiment
    from ndjax.hardware.flops import flops_per_token
    from ndjax.ops import attention as attention_ops

    settings = as_settings(config)
    impl = settings.model.attn_impl
    on_target = platforms.of(devices) == "gpu"  # the GPU compiler: no stand-ins
    target = target_settings(settings, layout, impl if on_target
                             else attention_ops.stand_in(impl))
    if not on_target and target.model.moe_impl == "mosaic":
        # The Mosaic GPU kernels compile for GPUs only.
        target = dataclasses.replace(target, model=dataclasses.replace(target.model,
                                                                       moe_impl="xla"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exp = Experiment.from_config(target, devices, inputs)
    # What a GPU runs: the config's own choices (the CPU experiment above resolved
    # auto for a CPU), cuDNN or Pallas compiled as their CPU stand-in here.
    t = target.train
    site = dataclasses.replace(
        attention_ops.Site.of(exp.model_cfg, t.seq_len, exp.rules,
                              t.batch_size // t.grad_accum),
        platform="gpu", compute_capability=hardware.compute_capability,
        cp_impl=layout.cp_impl)
    choice = attention_ops.choose(impl, site)
    on_gpu = choice.name
    stand_in = on_gpu if on_target else attention_ops.stand_in(on_gpu)
    target = dataclasses.replace(target, model=dataclasses.replace(
        target.model, attn_impl=stand_in, cp_impl=choice.cp or target.model.cp_impl))
    attention = choice.label if stand_in == on_gpu else f"{choice.label} (compiled as {stand_in})"
    tokens = t.batch_size * t.seq_len
    signature = (layout.remat, layout.grad_accum, layout.microbatches, layout.virtual_stages,
                 layout.pipeline_schedule,
                 target.model.attn_impl, target.model.cp_impl,
                 program_signature(exp.rules, exp.mesh))
    rerun = pipeline_rerun_flops(exp.model_cfg, t.seq_len, layout.remat, layout) * tokens
    model_flops = flops_per_token(exp.model_cfg, t.seq_len) * tokens
    return Checked(layout, target, attention, model_flops, tokens, signature,
                   argument_bytes(exp), recompute_flops=rerun,
                   least_link=traffic_bound.least_traffic(exp, devices, devices_per_node),
                   executed_flops=executed_flops(exp.model_cfg, layout, model_flops + rerun,
                                                 tokens))


def executed_flops(cfg: Any, layout: Layout, flops: float, tokens: int) -> float | None:
    """What the devices compute in one step of a layout with stages, all devices, from
    ``flops`` (the model's and remat's): the schedule runs every stage at every tick,
    the bubble's on zeros, so the layers take passes / (chunks x micro-batches) of their
    work (``GPipe.passes``); the embedding, LM head and loss run outside the stages on
    every stage's devices, once per stage (DeepSeek V3's dense first layers too: not
    counted). None without stages."""
    plan = layout.schedule
    if plan is None:
        return None
    head = decoder.head_flops_per_token(cfg) * tokens
    return (flops - head) * plan.passes / (plan.virtual * plan.microbatches) + head * plan.stages


def pipeline_rerun_flops(cfg: Any, seq_len: int, remat: str, layout: Layout) -> float:
    """FLOPs per token the backward pass runs again: ``remat``'s, and under the circular
    and 1F1B schedules every layer's forward once more (each chunk is rematerialised
    whole, ``pipeline.Circular``, ``pipeline.OneFOneB``)."""
    rerun = sum(roofline.recomputed_forward_flops(cfg, seq_len, remat).values())
    if layout.stage > 1 and (layout.virtual_stages > 1 or layout.pipeline_schedule == "1f1b"):
        rerun += sum(roofline.recomputed_forward_flops(cfg, seq_len, "full").values())
    return rerun


def argument_bytes(exp: Any) -> int:
    """The train step's inputs per device, from their shardings: the parameters,
    optimizer state and batch a compile would report as its arguments."""
    return bytes_per_device((exp.abstract_state, exp.abstract_batch))


def bytes_per_device(tree: Any) -> int:
    """The bytes one device holds of a tree of sharded abstract arrays."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
               for x in jax.tree.leaves(tree))


def program_signature(rules: Any, mesh: Any) -> tuple:
    """Equal for two (mesh, rule table) pairs that compile to the same program on the
    same devices in the same order: axis names do not matter, only which names split
    over which runs of devices. Mesh axes of size 1 are dropped, and two adjacent axes
    that every name uses together (or not at all) are one axis of their product's
    size: ``zero3_everywhere`` on replica=2 x fsdp=4 is ``default`` on fsdp=8."""
    axes = [a for a in mesh.axis_names if mesh.shape[a] > 1]
    names = sorted({name for name, _ in rules.table})
    uses = {n: rules.axes_of(n) for n in names}
    groups = [[a] for a in axes]
    i = 0
    while i + 1 < len(groups):
        a, b = groups[i][-1], groups[i + 1][0]
        if all((a in u) == (b in u) and (a not in u or u.index(b) == u.index(a) + 1)
               for u in uses.values()):
            groups[i] += groups.pop(i + 1)
        else:
            i += 1
    index = {a: k for k, g in enumerate(groups) for a in g}
    sizes = tuple(math.prod(mesh.shape[a] for a in g) for g in groups)
    return sizes, tuple((n, tuple(dict.fromkeys(index[a] for a in uses[n]))) for n in names)


# ----- compiling, in worker processes, with a cache ------------------------------------------


def _source_digest() -> str:
    """ndjax's own code: a change to it invalidates every cached measurement."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # ndjax/, not planning/
    h = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                with open(os.path.join(folder, name), "rb") as f:
                    h.update(name.encode() + f.read())
    return h.hexdigest()


def config_from_json(text: str) -> ml_collections.ConfigDict:
    config = default_config()
    config.update(json.loads(text))
    return config


def measure(config_json: str, n: int, target: str | None = None,
            per_node: int = 8, stderr_file: str | None = None) -> dict[str, Any]:
    """Compile the train step of one layout for n devices and read it: the first n
    CPU devices, or with ``target`` (a ``roofline.HARDWARE`` name) n GPUs of that
    kind, ``per_node`` to a node, by XLA's GPU compiler (``ndjax.hardware.gpu_target``).
    XLA's native stderr is captured (into ``stderr_file`` where given)."""
    from ndjax.experiment import Experiment
    from ndjax.hardware import gpu_target
    from ndjax.runtime.console import native_stderr

    config = config_from_json(config_json)
    start = time.perf_counter()
    try:
        with warnings.catch_warnings(), native_stderr(echo=False, into=stderr_file) as native:
            warnings.simplefilter("ignore")
            if target:
                devices = gpu_target.devices(gpu_target.hardware(target), n, per_node)
                exp = Experiment.from_config(config, devices)
                compiled = exp.compiled_step  # with the GPU options train.py compiles with
            else:
                devices = jax.devices()[:n]
                exp = Experiment.from_config(config, devices)
                compiled = compiler.compile_step(
                    exp.lower_step(), {**compiler.options("cpu"), **MEASURE_OPTIONS}, "cpu")
    except Exception as e:  # noqa: BLE001 -- a layout XLA cannot compile is a result too
        return {"error": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"}
    seconds = time.perf_counter() - start
    m = compiled.memory_analysis()
    records = collective_records(compiled.as_text(), exp.mesh, devices)
    return dict(arguments=int(m.argument_size_in_bytes), temporaries=int(m.temp_size_in_bytes),
                host=int(m.host_temp_size_in_bytes + m.host_argument_size_in_bytes),
                compile_s=round(seconds, 2), collectives=records,
                rematerializations=native.rematerializations)


def collective_records(hlo: str, mesh: Any, devices: Sequence[jax.Device],
                       unknown_trips: int | None = None) -> list[dict]:
    """Every collective of a compiled step as a record, its groups as positions in
    ``devices`` (partition p of the program runs on the mesh's p-th device);
    ``unknown_trips`` as ``collectives``'."""
    position = {d.id: i for i, d in enumerate(devices)}
    order = [position[d.id] for d in mesh.devices.flat]
    return [dict(kind=c.kind, dtype=c.dtype, bytes=c.bytes, ring_bytes=c.ring_bytes,
                 group_size=c.group_size, executed=c.executed,
                 groups=[[order[p] for p in g] for g in c.groups])
            for c in collectives(hlo, cpu_compiled=platforms.of(devices) != "gpu",
                                 unknown_trips=unknown_trips)]


class Cache:
    """One JSON file per measurement under ``root``; writes are atomic."""

    def __init__(self, root: str | None):
        self.root = root
        self._salt = f"{jax.__version__}:{_source_digest()}" if root else ""

    def key(self, config_json: str, n: int, target: str = "cpu") -> str:
        text = f"{self._salt}:{n}:{target}:{config_json}"
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def get(self, key: str) -> dict | None:
        if not self.root:
            return None
        try:
            with open(os.path.join(self.root, key + ".json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def put(self, key: str, value: dict) -> None:
        if not self.root or "error" in value:
            return
        os.makedirs(self.root, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(value, f)
        os.replace(tmp, os.path.join(self.root, key + ".json"))


def _start_worker(n: int, parent: int) -> None:
    children.die_with_parent(parent)  # a planner killed with SIGKILL takes its workers along
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)


def _last_words(path: str) -> str:
    """The fatal line of XLA's log (``F1207 12:00:00.0 123 file.cc:45] message``) in a
    dead process's captured stderr, else its last line."""
    try:
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        lines = []
    fatal = [line for line in lines if re.match(r"F\d{4} ", line)]
    said = (fatal or lines or ["it wrote nothing"])[-1]
    return re.sub(r"^F\d{4} [\d:.]+\s+\d+\s+", "", said)[:300]


class Compiler:
    """Measures configs on n simulated devices, or for n GPUs of kind ``target`` with
    the GPU compiler: from the cache, else in ``workers`` processes (0: in this
    process, which must then have n CPU devices where ``target`` is None)."""

    def __init__(self, n: int, workers: int, cache: Cache,
                 progress: Callable[[str], None] = lambda _: None,
                 target: str | None = None, per_node: int = 8):
        self.n, self.cache, self.progress = n, cache, progress
        self.workers = workers
        self.target, self.per_node = target, per_node
        self._started: dict[concurrent.futures.Future, tuple[str, bool, str]] = {}
        self.compiled = self.cached = 0  # measurements taken, by where they came from
        self._pool = self._new_pool(workers) if workers > 0 else None

    # What a worker runs (a test swaps it for one that aborts its process).
    _measure = staticmethod(measure)

    def _new_pool(self, workers: int) -> concurrent.futures.ProcessPoolExecutor:
        return concurrent.futures.ProcessPoolExecutor(
            max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
            initializer=_start_worker, initargs=(self.n, os.getpid()))

    def describe(self) -> str:
        if self.target:
            return f"compiling with XLA's GPU compiler for {roofline.HARDWARE[self.target].name}"
        from ndjax.hardware.gpu_target import INSTALL
        return ("compiling with the CPU compiler on simulated devices, a stand-in (the GPU's "
                f"own figures: {INSTALL})")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)

    def start(self, config: ml_collections.ConfigDict) -> concurrent.futures.Future:
        """One measurement of ``config``: from the cache (done at once), else begun in a
        worker (without workers: done here before this returns). ``result`` takes it."""
        text = config.to_json(sort_keys=True)
        key = self.cache.key(text, self.n, f"{self.target}/{self.per_node}" if self.target
                             else "cpu")
        hit = self.cache.get(key)
        if hit is not None or self._pool is None:
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_result(hit if hit is not None
                              else self._measure(text, self.n, self.target, self.per_node))
        else:
            try:
                future = self._submit(text)
            except BrokenProcessPool:  # a worker died: new ones
                self._pool = self._new_pool(self.workers)
                future = self._submit(text)
        self._started[future] = (key, hit is not None, text)
        return future

    def _submit(self, text: str) -> concurrent.futures.Future:
        assert self._pool is not None
        return self._pool.submit(self._measure, text, self.n, self.target, self.per_node)

    def finished(self, futures: Iterable[concurrent.futures.Future]
                 ) -> list[concurrent.futures.Future]:
        """Those of ``futures`` that are done, waiting for one at least, in the order
        they were started."""
        done, _ = concurrent.futures.wait(list(futures),
                                          return_when=concurrent.futures.FIRST_COMPLETED)
        return [f for f in self._started if f in done]  # _started keeps the start order

    def result(self, future: concurrent.futures.Future) -> dict:
        """A finished measurement's record, stored in the cache."""
        key, cached, text = self._started.pop(future)
        try:
            r = future.result()
        except BrokenProcessPool:
            r = self._alone(text)
        if cached:
            self.cached += 1
        else:
            if "aborted" not in r:  # not kept: the process may have died of something else
                self.cache.put(key, r)
            self.compiled += 1
        if (self.compiled + self.cached) % 5 == 0:
            self.progress(self.tally())
        return r

    def _alone(self, text: str) -> dict:
        """A measurement whose worker died (XLA aborts the process on some programs),
        again in a process of its own: the pool's death fails every measurement in
        flight, and only the one that dies alone is the cause."""
        pool = self._new_pool(1)
        with tempfile.TemporaryDirectory(prefix="ndjax-plan-") as tmp:
            said = os.path.join(tmp, "stderr")
            try:
                return pool.submit(self._measure, text, self.n, self.target,
                                   self.per_node, said).result()
            except BrokenProcessPool:
                return {"error": "XLA aborted the process compiling it: " + _last_words(said),
                        "aborted": True}
            finally:
                pool.shutdown(cancel_futures=True)

    def tally(self) -> str:
        return f"measured {self.compiled + self.cached} step(s) ({self.cached} cached)"


# ----- the plan --------------------------------------------------------------------------------


@dataclasses.dataclass
class Candidate:
    layout: Layout
    status: str = "rejected"     # ranked | over | rejected | failed
    reason: str = ""             # why rejected / failed / over, or what was changed to fit
    attention: str = ""
    arguments: int = 0
    temporaries: int = 0
    host: int = 0                # pinned host memory per device (model.remat=offload)
    compile_s: float = 0.0
    collectives: list[dict] = dataclasses.field(default_factory=list)
    estimate: roofline.Estimate | None = None
    link: roofline.Link | None = None
    tried: list[str] = dataclasses.field(default_factory=list)  # remedies that did not fit
    aliases: list[str] = dataclasses.field(default_factory=list)  # the same program
    least_memory: int = 0        # the smallest of the tries, when none fits
    cannot_rank: str = ""        # why its remedies were not compiled (_search)
    # A lower bound of its step time before compiling (Checked.least_step_s), seconds.
    least_step_s: float = 0.0
    # The SPMD partitioner's "involuntary full rematerialization" warnings: a
    # resharding it could only do by gathering a whole tensor (time and memory).
    rematerializations: list[str] = dataclasses.field(default_factory=list)

    @property
    def memory(self) -> int:
        return self.arguments + self.temporaries

    def as_dict(self) -> dict[str, Any]:
        e, link = self.estimate, self.link
        plan = self.layout.schedule
        out = dict(mesh=dict(zip(AXES, self.layout.degrees)), rules=self.layout.rules,
                   remat=self.layout.remat, grad_accum=self.layout.grad_accum,
                   cp_impl=self.layout.cp_impl, microbatches=self.layout.microbatches,
                   bubble=plan.bubble if plan else 0.0,
                   status=self.status, reason=self.reason, aliases=self.aliases,
                   least_step_s=self.least_step_s)
        if self.status in ("ranked", "over"):
            out.update(attention=self.attention, arguments_bytes=self.arguments,
                       temporaries_bytes=self.temporaries, memory_bytes=self.memory,
                       host_bytes=self.host,
                       compile_s=self.compile_s, tried=self.tried,
                       rematerializations=self.rematerializations)
        if e is not None and link is not None:
            out.update(
                bytes_inside_nodes=round(link.inside_bytes),
                bytes_across_nodes=round(link.across_bytes),
                bytes_by_kind={k: round(link.inside.get(k, 0) + link.across.get(k, 0))
                               for k in sorted({*link.inside, *link.across})},
                compute_s=e.compute_s, communication_s=e.communication_s,
                step_s=e.serial_s, step_s_overlapped=e.overlapped_s,
                tokens_per_s=e.tokens_per_s(), mfu=e.mfu())
        return out


@dataclasses.dataclass
class Plan:
    devices: int
    hardware: roofline.Hardware
    devices_per_node: int
    budget: float                # bytes per device a step may use
    candidates: list[Candidate]
    aliases: int                 # layouts that are another's program (Candidate.aliases)
    model: Any                   # ndjax.models.decoder.DecoderConfig, in the target's dtypes
    measured_by: str = "cpu"     # the compiler: "cpu", or the GPU kind compiled for

    def by_status(self, status: str) -> list[Candidate]:
        return [c for c in self.candidates if c.status == status]


def _remedies(layout: Layout, batch_per_device_rows: int, offload: bool = False
              ) -> list[Layout]:
    """What to try, in order, when only the activations do not fit; ``offload``: the
    host-offload rung after ``full`` (measured by the GPU compiler only). A GPipe
    layout tries 1F1B after ``full``, at its own remat: a stage then holds at most
    2 x stages - 1 micro-batches' activations instead of all of them, for a forward
    run again as ``full`` runs one, and more gathers (so not before ``full``, which
    mostly fits, to save compiles). Where the run cannot take 1F1B, its check says so
    and the rung is skipped."""
    out = []
    ladder = (*REMAT_LADDER, OFFLOAD) if offload else REMAT_LADDER
    ladder = ladder if layout.remat in ladder else (layout.remat, "full")
    gpipe = layout.stage > 1 and layout.virtual_stages == 1 and \
        layout.pipeline_schedule == "gpipe"
    for remat in ladder[ladder.index(layout.remat) + 1:]:
        out.append(layout.with_(remat=remat))
        if remat == "full" and gpipe:
            out.append(layout.with_(pipeline_schedule="1f1b"))
    k = layout.grad_accum * 2
    while k <= batch_per_device_rows * layout.grad_accum:
        out.append(layout.with_(remat="full", grad_accum=k))
        k *= 2
    return out


def _describe_fix(base: Layout, layout: Layout) -> str:
    parts = []
    if layout.remat != base.remat:
        parts.append(f"model.remat={layout.remat}")
    if layout.grad_accum != base.grad_accum:
        parts.append(f"train.grad_accum={layout.grad_accum}")
    if layout.pipeline_schedule != base.pipeline_schedule:
        parts.append(f"mesh.pipeline_schedule={layout.pipeline_schedule}")
    return "fits with " + " and ".join(parts) if parts else ""


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _check_all(config: Settings, n: int, hardware: roofline.Hardware,
               devices: Sequence[jax.Device], presets: Sequence[str] | None, inputs: Any,
               devices_per_node: int = 8, stages: Sequence[int] | None = ()
               ) -> tuple[list[Candidate], dict[int, Checked], int]:
    """Every layout through the checks: rejected ones with their reason, and one
    candidate per distinct program, under its plainest name (the default rules, then
    the fewest replicas) with the others as its aliases."""
    rejected: list[Candidate] = []
    checked: dict[int, Checked] = {}
    same: dict[tuple, list[Candidate]] = {}
    for layout in layouts(config, n, presets, devices_per_node, stages):
        cand = Candidate(layout)
        try:
            c = check(config, layout, devices, hardware, inputs, devices_per_node)
        except ConfigError as e:
            cand.reason = " ".join(str(e).split())
            rejected.append(cand)
            continue
        cand.attention = c.attention
        checked[id(cand)] = c
        same.setdefault(c.signature, []).append(cand)
    distinct = []
    for group in same.values():
        group.sort(key=lambda c: (c.layout.rules not in ("default", CONFIG_RULES),
                                  c.layout.replica))
        group[0].aliases = [f"{c.layout.mesh} [{c.layout.settings}]" for c in group[1:]]
        distinct.append(group[0])
    return distinct + rejected, checked, sum(len(g) - 1 for g in same.values())


def _fill(cand: Candidate, r: dict, c: Checked, hardware: roofline.Hardware,
          devices_per_node: int, budget: float) -> None:
    """A candidate's measurement, traffic and estimate, from ``measure``'s record."""
    if "error" in r:
        cand.status, cand.reason = "failed", r["error"]
        return
    cand.layout = c.layout
    cand.arguments, cand.temporaries = r["arguments"], r["temporaries"]
    cand.host = r.get("host", 0)
    cand.compile_s, cand.collectives = r["compile_s"], r["collectives"]
    cand.rematerializations = r.get("rematerializations", [])
    cand.link = roofline.traffic(r["collectives"], devices_per_node)
    cand.estimate = c.estimate(hardware, cand.link, cand.host)
    cand.status = "ranked" if _fits(r, hardware, budget) else "over"


def _fits(r: dict, hardware: roofline.Hardware, budget: float) -> bool:
    return hardware.fits(r["arguments"] + r["temporaries"], r.get("host", 0),
                         budget / hardware.memory_bytes)


def _label(layout: Layout) -> str:
    return (f"remat {layout.remat}, grad_accum {layout.grad_accum}"
            + (", 1F1B" if layout.stage > 1 and layout.pipeline_schedule == "1f1b" else ""))


def _kth_best(candidates: Sequence[Candidate], top: int | None) -> float:
    """The step time a layout must beat to be among the ``top`` best that fit so far
    (infinite while fewer fit, or with ``top`` None: every remedy is tried)."""
    times = sorted(c.estimate.serial_s for c in candidates
                   if c.status == "ranked" and c.estimate is not None)
    return times[top - 1] if top is not None and len(times) >= top else math.inf


def _at_least(cand: Candidate, c: Checked, hardware: roofline.Hardware) -> float:
    """A lower bound of ``c``'s step time from ``cand``'s measurement at less remat:
    more remat (or accumulation) adds compute and never removes a collective, so the
    communication measured there and the compute of ``c``'s remat bound it below."""
    return c.estimate(hardware, cand.link, cand.host).serial_s


@dataclasses.dataclass
class _Try:
    """One compile the search may make: a candidate's layout as checked (``remedy``: one
    of its rungs after it compiled over the budget), and a lower bound of its step time."""

    bound: float
    cand: Candidate
    checked: Checked
    remedy: bool = False


def _next_rung(cand: Candidate, queue: list[Layout], config: Settings,
               devices: Sequence[jax.Device], hardware: roofline.Hardware, inputs: Any,
               devices_per_node: int) -> _Try | None:
    """The next remedy of ``queue`` that passes the checks, bounded below by the
    candidate's measured communication (``_at_least``); None when none is left."""
    while queue:
        layout = queue.pop(0)  # more accumulation: fewer rows to cut into micro-batches
        try:
            c = check(config, layout.with_(microbatches=microbatches(config, layout)),
                      devices, hardware, inputs, devices_per_node)
        except ConfigError:  # e.g. a grad_accum the batch does not split into
            continue
        return _Try(_at_least(cand, c, hardware), cand, c, remedy=True)
    return None


def _search(config: Settings, pending: list[Candidate], checked: dict[int, Checked],
            compiler: Compiler, hardware: roofline.Hardware, devices: Sequence[jax.Device],
            devices_per_node: int, budget: float, top: int | None, inputs: Any) -> None:
    """Compile the candidates, and the remedies of those over the budget, least step
    time first. Each candidate is compiled as configured; one whose parameters,
    optimizer state and batch fit but whose step does not is retried with more remat,
    then grad_accum, one rung at a time, until it fits or nothing is left to try.

    With ``top``, every possible compile waits in one queue ordered by a lower bound of
    its step time: a candidate's from its shardings (``Checked.least_step_s``), a rung's
    from the communication measured at less remat and its own compute (``_at_least``).
    Each worker takes the lowest as it frees up, until the lowest left cannot beat the
    ``top``-th best that fits. What is left is provably slower: a candidate is
    ``slower`` (not compiled), a rung's candidate stays over and says why. So remedies
    need not wait for every first compile, and a layout that fits only with remat full
    can set the bar that stops the rest. Without ``top`` everything is compiled.

    The ``top`` best are the same however the compiles interleave; with workers, which
    of the others were compiled before the bar stopped them can differ between runs."""
    for cand in pending:
        cand.least_step_s = checked[id(cand)].least_step_s(hardware)
    waiting = [_Try(cand.least_step_s, cand, checked[id(cand)]) for cand in pending]
    running: dict[concurrent.futures.Future, _Try] = {}
    queues: dict[int, list[Layout]] = {}
    given: dict[int, tuple[Layout, str]] = {}
    while waiting or running:
        best = _kth_best(pending, top)
        waiting.sort(key=lambda t: t.bound)
        while waiting and len(running) < max(compiler.workers, 1) and \
                waiting[0].bound <= best:
            t = waiting.pop(0)
            running[compiler.start(t.checked.config)] = t
        if not running:
            break
        for future in compiler.finished(running):
            t = running.pop(future)
            if _take(t, compiler.result(future), queues, given, compiler.target is not None,
                     hardware, devices_per_node, budget):
                rung = _next_rung(t.cand, queues[id(t.cand)], config, devices, hardware,
                                  inputs, devices_per_node)
                if rung is not None:
                    waiting.append(rung)
    compiler.progress(compiler.tally())
    best = _kth_best(pending, top)
    for t in waiting:
        if t.remedy:
            t.cand.cannot_rank = (f"it could only rank below #{top}: with "
                                  f"{_label(t.checked.layout)} its step takes at least "
                                  f"{t.bound * 1e3:,.1f} ms, #{top} takes {best * 1e3:,.1f}")
        else:
            t.cand.status = "slower"
            t.cand.reason = (f"not compiled: its step takes at least {t.bound * 1e3:,.1f} ms "
                             f"(its compute and the traffic its shardings force), #{top} "
                             f"takes {best * 1e3:,.1f}")


def _take(t: _Try, r: dict, queues: dict[int, list[Layout]],
          given: dict[int, tuple[Layout, str]], offload: bool,
          hardware: roofline.Hardware, devices_per_node: int, budget: float) -> bool:
    """A compile's record into its candidate (``_search``): filled in where it fits or
    has nothing to retry; else its remedies queued (a first compile over the budget;
    ``offload`` as ``_remedies``') or its failed try noted. True: try its next rung."""
    cand, c = t.cand, t.checked
    if not t.remedy:
        _fill(cand, r, c, hardware, devices_per_node, budget)
        if cand.status != "over" or cand.arguments > budget:
            return False
        rows = (c.config.train.batch_size // (cand.layout.replica * cand.layout.fsdp)
                // c.config.train.grad_accum)
        queues[id(cand)] = _remedies(cand.layout, rows, offload)
        cand.least_memory = cand.memory
        given[id(cand)] = (cand.layout, f"{_label(cand.layout)}: {_gib(cand.memory)}")
        return True
    total = r["arguments"] + r["temporaries"] if "error" not in r else None
    if total is not None and _fits(r, hardware, budget):
        _fill(cand, r, c, hardware, devices_per_node, budget)
        cand.tried.insert(0, given[id(cand)][1])
        cand.reason = _describe_fix(given[id(cand)][0], c.layout)
        return False
    cand.tried.append(f"{_label(c.layout)}: " + (r.get("error") or _gib(total)))
    if total is None:  # failed to compile: with more accumulation it fails the same way
        queues[id(cand)][:] = [
            later for later in queues[id(cand)]
            if (later.remat, later.pipeline_schedule)
            != (c.layout.remat, c.layout.pipeline_schedule)]
    else:
        if c.layout.grad_accum > 1 and total > cand.least_memory:
            # Accumulation added a gradient buffer and saved less: more won't help.
            queues[id(cand)].clear()
        cand.least_memory = min(cand.least_memory, total)
    return True


def _why_over(cand: Candidate, budget: float) -> str:
    if cand.arguments > budget:
        return (f"parameters, optimizer state and batch alone need {_gib(cand.arguments)} of "
                f"{_gib(budget)}: shard them over more devices (fsdp) or store them in "
                "bfloat16 (model.param_dtype, train.opt_state_dtype)")
    if cand.cannot_rank:
        tried = f" (tried: {'; '.join(cand.tried)})" if cand.tried else ""
        return f"not retried with more remat: {cand.cannot_rank}{tried}"
    return (f"{_gib(cand.least_memory - budget)} over the budget at best (tried: "
            f"{'; '.join(cand.tried)}): gradients and optimizer state need more sharding")


def make_plan(config: ml_collections.ConfigDict, n: int, hardware: roofline.Hardware,
              devices_per_node: int, mem_fraction: float, compiler: Compiler,
              devices: Sequence[jax.Device], presets: Sequence[str] | None = None,
              progress: Callable[[str], None] = lambda _: None,
              top: int | None = None, stages: Sequence[int] | None = ()) -> Plan:
    """Check, compile and price every layout (see the module docstring). With ``top``,
    what cannot rank among the ``top`` best is not compiled: a layout whose
    parameters, optimizer state and batch alone overflow the budget, and remedies
    that could not beat the ``top``-th best step time. ``stages``: as ``layouts``'
    (by default none: a sixth axis more than doubles the layouts to check and compile)."""
    from ndjax.experiment import check_inputs

    # What no layout changes is checked once (a bad field there is the user's error),
    # and its inputs (checkpoint, data, tokenizer) opened once for every layout.
    settings = as_settings(config)
    base = Layout(n, 1, 1, 1, remat=settings.model.remat,
                  grad_accum=settings.train.grad_accum)
    model, inputs = check_inputs(target_settings(settings, base))
    budget = hardware.memory_bytes * mem_fraction
    progress(compiler.describe())
    candidates, checked, aliases = _check_all(settings, n, hardware, devices, presets, inputs,
                                              devices_per_node, stages)
    pending = [c for c in candidates if id(c) in checked]
    progress(f"{len(pending) + aliases} layouts pass the checks ({len(pending)} distinct "
             f"programs), {len(candidates) - len(pending)} rejected")
    for cand in pending:  # its inputs alone do not fit: nothing to compile
        if checked[id(cand)].arguments > budget:
            cand.status, cand.arguments = "over", checked[id(cand)].arguments
    pending = [c for c in pending if c.status != "over"]
    _search(settings, pending, checked, compiler, hardware, devices, devices_per_node, budget,
            top, inputs)
    for cand in candidates:
        if cand.status == "over":
            cand.reason = _why_over(cand, budget)
    order = {"ranked": 0, "over": 1, "slower": 2, "failed": 3, "rejected": 4}
    candidates.sort(key=lambda c: (order[c.status],
                                   c.estimate.serial_s if c.status == "ranked" and c.estimate
                                   else c.memory if c.status == "over" else 0))
    return Plan(n, hardware, devices_per_node, budget, candidates, aliases, model,
                compiler.target or "cpu")


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ndjax", "plan")


def mem_fraction_default() -> float:
    """What jax's GPU allocator takes: XLA_PYTHON_CLIENT_MEM_FRACTION, else 0.75."""
    try:
        return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
    except ValueError:
        return 0.75
