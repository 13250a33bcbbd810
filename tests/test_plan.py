"""The layout planner (ndjax plan): candidates, checks, compiled memory, remedies."""

import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import jax
import pytest
from conftest import tiny_config

from ndjax.config import as_settings
from ndjax.experiment import Experiment, model_config
from ndjax.hardware import roofline
from ndjax.planning import planner
from ndjax.runtime import compiler
from ndjax.runtime.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100 = roofline.HARDWARE["h100"]


def test_factorizations_are_every_mesh_once():
    for n, count in ((1, 1), (8, 20), (64, 84), (12, 40)):
        meshes = planner.factorizations(n)
        assert len(meshes) == len(set(meshes)) == count
        assert all(math.prod(m) == n for m in meshes)
    # The expert axis only for a mixture of experts, and only degrees dividing its experts.
    assert {m[3] for m in planner.factorizations(8, experts=4)} == {1, 2, 4}
    assert len(planner.factorizations(8, experts=4)) == 20 + 10 + 4


def _signature(mesh, rules):
    config = tiny_config(mesh={"replica": 1, "fsdp": 1, "context": 1, "tensor": 1, **mesh},
                         rules=rules)
    layout = planner.Layout(**{"replica": 1, "fsdp": 1, "context": 1, "tensor": 1, **mesh},
                            rules=rules)
    return planner.check(config, layout, jax.devices(), H100).signature


def test_equivalent_layouts_share_one_program():
    fsdp8 = _signature({"fsdp": 8}, "default")
    assert _signature({"replica": 2, "fsdp": 4}, "zero3_everywhere") == fsdp8
    assert _signature({"replica": 8}, "zero3_everywhere") == fsdp8
    assert _signature({"fsdp": 8}, "megatron_sp") == fsdp8  # no tensor axis: the same table
    assert _signature({"replica": 2, "fsdp": 4}, "default") != fsdp8  # replicas keep copies
    assert _signature({"fsdp": 4, "tensor": 2}, "megatron_sp") != _signature(
        {"fsdp": 4, "tensor": 2}, "default")


def test_planned_memory_equals_the_compiled_train_step():
    """The planner compiles without LLVM's optimisations; the buffers must be the
    ones of the step train.py compiles and runs, with XLA's default optimisation
    levels (which the suite's XLA_FLAGS turn off, tests/conftest.py)."""
    config = tiny_config(model={"dtype": "bfloat16"}, train={"seq_len": 64})
    layout = planner.Layout(1, 4, 1, 2, remat="none")
    checked = planner.check(config, layout, jax.devices(), H100)
    assert checked.config.model.attn_impl == "tiled"  # cuDNN on an H100, tiled here
    planned = planner.measure(checked.config.to_json(sort_keys=True), 8)
    defaults = {**compiler.options("cpu"), "xla_backend_optimization_level": 3,
                "xla_llvm_disable_expensive_passes": False}
    exp = Experiment.from_config(checked.config)
    m = exp.lower_step().compile(compiler_options=defaults).memory_analysis()
    assert planned["arguments"] == m.argument_size_in_bytes
    assert planned["temporaries"] == m.temp_size_in_bytes
    kinds = {c["kind"] for c in planned["collectives"]}
    assert {"all-gather", "all-reduce"} <= kinds


def test_argument_bytes_from_the_shardings_are_the_compiled_arguments():
    """What lets the planner skip compiling a layout whose inputs alone overflow."""
    for mesh, rules in ((dict(fsdp=4, tensor=2), "default"),
                        (dict(replica=2, fsdp=2, context=2), "megatron_sp")):
        exp = Experiment.from_config(tiny_config(mesh=mesh, rules=rules))
        compiled = exp.lower_step().compile().memory_analysis().argument_size_in_bytes
        # One int32 scalar of the state (a second step count) is unused by the
        # step, and XLA drops it from the compiled arguments.
        assert planner.argument_bytes(exp) == compiled + 4


def _plan(config, hardware, cache_dir, messages, n=2, top=None):
    compiler = planner.Compiler(n, 0, planner.Cache(str(cache_dir)), messages.append)
    return planner.make_plan(config, n, hardware, 8, 1.0, compiler, jax.devices()[:n],
                             ["default"], messages.append, top)


def _compiles(messages):
    """Steps a plan measured, compiled or from the cache: its last tally ('measured 3
    step(s) (2 cached)')."""
    found = [re.match(r"measured (\d+) step\(s\) \((\d+) cached\)", m) for m in messages]
    return int([f for f in found if f][-1][1])


FATAL = "hlo_instruction.cc:1234] Invalid binary instruction opcode copy"


def _measure_or_abort(text, n, target=None, per_node=8, stderr_file=None):
    """In a worker, XLA's part in an abort: a config of 3 layers writes a fatal line as
    XLA's log does and aborts the process (SIGABRT, as LOG(FATAL) does); the others
    return a record of their layers. No compile: what is checked is the planner's."""
    from ndjax.runtime.console import native_stderr
    layers = json.loads(text)["model"]["n_layers"]
    with native_stderr(echo=False, into=stderr_file):
        if layers == 3:
            os.write(2, f"F1207 19:00:00.000000  123 {FATAL}\n".encode())
            os.abort()
    return {"layers": layers}


class _Aborting(planner.Compiler):
    _measure = staticmethod(_measure_or_abort)


def test_a_layout_that_aborts_the_compiler_fails_and_the_others_are_measured(tmp_path):
    """A worker killed by XLA breaks the pool and fails every measurement in flight:
    each is measured again alone, the one that dies alone is failed with XLA's fatal
    line (and not cached), and later measurements get a new pool."""
    compiler = _Aborting(2, 2, planner.Cache(str(tmp_path)))
    try:
        started = {compiler.start(tiny_config(model=dict(n_layers=k))): k for k in (2, 3, 4)}
        got = {}
        while started:
            for future in compiler.finished(started):
                got[started.pop(future)] = compiler.result(future)
        assert got == {2: {"layers": 2}, 4: {"layers": 4},
                       3: {"error": f"XLA aborted the process compiling it: {FATAL}",
                           "aborted": True}}
        again = compiler.start(tiny_config(model=dict(n_layers=5)))
        assert compiler.result(again) == {"layers": 5}
        assert len(os.listdir(tmp_path)) == 3  # 2, 4 and 5 cached
    finally:
        compiler.close()


def test_a_layout_whose_inputs_overflow_is_not_compiled(tmp_path):
    config = tiny_config(train={"batch_size": 2, "seq_len": 64})
    messages = []
    tiny_gpu = dataclasses.replace(H100, memory_gb=1e-6)  # 1 kB: no layout's inputs fit
    plan = _plan(config, tiny_gpu, tmp_path, messages)
    assert _compiles(messages) == 0, messages
    over = plan.by_status("over")
    assert over and all("parameters, optimizer state and batch alone need" in c.reason
                        for c in over)


def test_plan_for_the_top_layouts_compiles_less_and_ranks_the_same(tmp_path):
    """--top=1 skips remedies that cannot beat the best fitting layout (their measured
    communication plus the compute of more remat is already slower): the winner is
    the exhaustive plan's; every layout it left is provably slower."""
    config = tiny_config(train={"batch_size": 2, "seq_len": 256})
    # One CP algorithm (both side by side: test_plan_rejects_with_reasons...): this
    # test is about pruning, and each context layout would compile twice.
    config.model.cp_impl = "ring"
    # And dense attention: the pruning does not depend on the kernel, and an H100's
    # (cuDNN, compiled here as tiled) makes this test 1.6x as long.
    config.model.attn_impl = "dense"
    every, some = [], []
    # One cache: the plans share their compiles, and _compiles counts what each measured.
    roomy = _plan(config, H100, tmp_path, every, n=2)
    need = sorted(c.memory for c in roomy.by_status("ranked"))
    tight = dataclasses.replace(H100, memory_gb=(need[0] + need[1]) / 2 / 1e9)
    every.clear()
    full = _plan(config, tight, tmp_path, every, n=2)
    best = _plan(config, tight, tmp_path, some, n=2, top=1)
    first = full.by_status("ranked")[0]
    # The least step time of each layout, from its shardings, is below what it compiles to
    # (ndjax.planning.traffic_bound), and not a trivial 0.
    compiled = [c for c in full.candidates if c.estimate is not None]
    assert compiled and all(0 < c.least_step_s <= c.estimate.serial_s for c in compiled)
    assert best.by_status("ranked")[0].layout == first.layout
    assert best.by_status("ranked")[0].estimate.serial_s == first.estimate.serial_s
    pruned = [c for c in best.candidates if c.cannot_rank]
    assert pruned, [c.reason for c in best.candidates]
    assert _compiles(some) < _compiles(every)
    exhaustive = {(c.layout.mesh, c.layout.settings): c for c in full.candidates}
    for c in pruned:
        assert c.status == "over" and "not retried with more remat" in c.reason
        there = exhaustive[c.layout.mesh, c.layout.settings]  # what its remedies gave
        assert there.status != "ranked" or there.estimate.serial_s > first.estimate.serial_s


def test_plan_rejects_with_reasons_and_fits_with_remat(tmp_path):
    config = tiny_config(train={"batch_size": 1, "seq_len": 256})
    messages = []
    roomy = _plan(config, H100, tmp_path, messages)
    rejected = roomy.by_status("rejected")
    # batch_size=1 cannot split over replica=2 or fsdp=2: named, with the fix.
    assert sorted(c.layout.mesh for c in rejected) == ["fsdp=2", "replica=2"]
    assert all("train.batch_size=1 is not divisible by 2" in c.reason for c in rejected)
    ranked = roomy.by_status("ranked")
    assert sorted(c.layout.mesh for c in ranked) == ["context=2", "context=2", "tensor=2"]
    assert all(c.layout.remat == "none" and c.estimate.serial_s > 0 for c in ranked)
    # One row on tensor=2: cuDNN's sharding rule fails there (ndjax.ops.attention.Cudnn),
    # so an H100 runs Pallas. context=2 is planned with both CP algorithms, side by
    # side: the ring, and cuDNN inside all-to-all (each device its heads, the whole
    # sequence), each compiled and priced with its own collectives.
    assert sorted((c.layout.cp_impl, c.attention) for c in ranked) == [
        ("all_to_all", "all_to_all+cudnn (compiled as tiled)"),
        ("auto", "pallas (compiled as tiled)"), ("ring", "ring")]
    by_cp = {c.layout.cp_impl: c.link.inside for c in ranked if c.layout.context == 2}
    assert by_cp["all_to_all"].get("all-to-all", 0) > 0 and "collective-permute" not in by_cp[
        "all_to_all"]
    assert by_cp["ring"].get("collective-permute", 0) > 0 and "all-to-all" not in by_cp["ring"]

    # A budget just under what remat=none needs: the planner finds more remat.
    need = {c.layout.settings + c.layout.mesh: c.memory for c in ranked}
    tight = dataclasses.replace(H100, memory_gb=(min(need.values()) - 1) / 1e9)
    messages.clear()
    plan = _plan(config, tight, tmp_path, messages)
    assert any("(3 cached)" in m for m in messages)  # the first plan's compiles
    for c in plan.by_status("ranked"):
        assert c.layout.remat != "none" and c.memory < need[c.layout.settings + c.layout.mesh]
        assert c.reason.startswith("fits with model.remat=") and c.tried
    for c in plan.by_status("over"):
        assert c.tried and "over the budget" in c.reason
    assert len(plan.by_status("ranked")) + len(plan.by_status("over")) == 3


def test_remedies_add_offload_where_the_gpu_compiler_measures():
    """After full, a GPU compile tries offload (the layer inputs in host memory); a CPU
    compile, whose host and device memory are one, goes on to gradient accumulation. A
    GPipe layout tries 1F1B after full."""
    base = planner.Layout(1, 2, 1, 1, remat="save_proj")
    cpu = [(x.remat, x.grad_accum) for x in planner._remedies(base, 4)]
    gpu = [(x.remat, x.grad_accum) for x in planner._remedies(base, 4, offload=True)]
    assert cpu == [("full", 1), ("full", 2), ("full", 4)]
    assert gpu == [("full", 1), ("offload", 1), ("full", 2), ("full", 4)]
    # A GPipe layout tries 1F1B at its own remat after full.
    staged = planner.Layout(1, 2, 1, 1, stage=2, microbatches=2)
    assert [(x.remat, x.grad_accum, x.pipeline_schedule) for x in
            planner._remedies(staged, 4)] == [
        ("save_proj", 1, "gpipe"), ("full", 1, "gpipe"), ("none", 1, "1f1b"),
        ("full", 2, "gpipe"), ("full", 4, "gpipe")]
    assert planner._describe_fix(staged, staged.with_(pipeline_schedule="1f1b")) == \
        "fits with mesh.pipeline_schedule=1f1b"


def test_a_rung_that_fails_to_compile_drops_its_more_accumulated_rungs():
    """A remedy that fails to compile (a staged MoE at remat full failed so on every
    rung of Mixtral 8x7B's plan) would fail the same with more accumulation: those
    rungs go, other schedules stay."""
    staged = planner.Layout(1, 2, 1, 1, stage=2, microbatches=2, remat="save_proj")
    cand = planner.Candidate(staged)
    queue = planner._remedies(staged, 4)  # full, 1F1B, full x accumulation 2 and 4
    first = queue.pop(0)
    tried = planner._Try(0.0, cand, planner.Checked(first, None, "", 0.0, 0, ()), remedy=True)
    again = planner._take(tried, {"error": "ValueError: no"}, {id(cand): queue},
                          {id(cand): (staged, "")}, False, H100, 8, 1e9)
    assert again and cand.tried == ["remat full, grad_accum 1: ValueError: no"]
    assert [(x.remat, x.grad_accum, x.pipeline_schedule) for x in queue] == [
        ("save_proj", 1, "1f1b")]


def test_layouts_plan_both_cp_algorithms_where_auto_chooses():
    config = tiny_config()
    every = planner.layouts(config, 4, ["default"])
    split = [x for x in every if x.context > 1]
    assert split and {x.cp_impl for x in split} == {"ring", "all_to_all"}
    assert len(split) == 2 * len({x.degrees for x in split})
    assert {x.cp_impl for x in every if x.context == 1} == {"auto"}
    config.model.cp_impl = "ring"
    assert {x.cp_impl for x in planner.layouts(config, 4, ["default"])} == {"ring"}


def test_stages_are_planned_over_whole_nodes_with_micro_batches():
    """The sixth axis: stage counts that divide the staged layers and give each stage
    whole nodes; each with GPipe's micro-batches, the most up to 4 a stage that split
    the batch's rows over the data axes (or the config's own)."""
    assert planner.stage_degrees(64, 32, 8) == [1, 2, 4, 8]   # Llama 3 8B on 8 nodes
    assert planner.stage_degrees(64, 58, 8) == [1, 2]         # DeepSeek V3's 58 MoE layers
    assert planner.stage_degrees(8, 32, 8) == [1]             # one node: no stages
    assert len(planner.factorizations(8, stages=(1, 2, 4))) == 20 + 10 + 4
    config = tiny_config(model={"n_layers": 4}, train={"batch_size": 16})
    assert all(x.stage == 1 for x in planner.layouts(config, 8, ["default"], 2))  # --stages=off
    assert {x.stage for x in planner.layouts(config, 8, ["default"], 2, stages=[2])} == {1, 2}
    every = planner.layouts(config, 8, ["default"], devices_per_node=2, stages=None)  # auto
    staged = {x.degrees: x.microbatches for x in every if x.stage > 1}
    assert {d[0] for d in staged} == {2, 4}
    assert all(x.microbatches == 0 for x in every if x.stage == 1)
    # (stage, replica, fsdp, expert, context, tensor): 16 rows over replica x fsdp.
    assert staged[2, 2, 2, 1, 1, 1] == 4 and staged[2, 1, 1, 1, 1, 4] == 8
    assert staged[4, 1, 2, 1, 1, 1] == 8 and staged[4, 1, 1, 1, 2, 1] == 16
    layout = planner.Layout(2, 2, 1, 1, stage=2, microbatches=4)
    assert layout.settings == "default, 4 micro-batches"
    assert layout.schedule.bubble == pytest.approx(1 / 5)
    config.train.microbatches = 2
    assert {x.microbatches for x in planner.layouts(config, 8, ["default"], 2, None)
            if x.stage > 1} == {2}


def test_a_staged_layout_is_priced_by_its_bubble_and_sends():
    """stage=2 x fsdp=2 on 2 devices a node: the compute is what GPipe's ticks run (the
    layers' FLOPs x ticks / micro-batches, the LM head once per stage); the stage sends
    are the compiled step's collective permutes, across nodes; the bound from the
    shardings (traffic_bound: the stage's own layers, never gathered over stage) stays
    below what the step compiles to."""
    config = tiny_config(model={"n_layers": 4, "attn_impl": "dense"},
                         train={"batch_size": 8, "seq_len": 64})
    layout = planner.Layout(1, 2, 1, 1, stage=2, microbatches=4)
    devices = jax.devices()[:4]
    checked = planner.check(config, layout, devices, H100, devices_per_node=2)
    cfg = checked.settings.model
    head = 6 * cfg.dim * cfg.vocab_size * checked.tokens
    ticks = 4 + 2 - 1
    assert checked.executed_flops == pytest.approx(
        (checked.model_flops + checked.recompute_flops - head) * ticks / 4 + 2 * head)
    assert "all-gather" not in checked.least_link.across  # no weight crosses the stages
    assert checked.least_link.across["collective-permute"] > 0
    cand = planner.Candidate(layout)
    planner._fill(cand, planner.measure(checked.config.to_json(sort_keys=True), 4), checked,
                  H100, 2, 1e12)
    assert cand.status == "ranked", cand.reason
    assert cand.link.across["collective-permute"] >= checked.least_link.across[
        "collective-permute"]
    assert cand.estimate.compute_s == pytest.approx(
        checked.executed_flops / 4 / (H100.peak_tflops * 1e12))
    assert 0 < checked.least_step_s(H100) <= cand.estimate.serial_s
    assert cand.as_dict()["bubble"] == pytest.approx(1 / 5)


@pytest.mark.parametrize("virtual, schedule, settings, passes", [
    (2, "gpipe", "default, 4 micro-batches, 2 chunks a stage", 9),
    (1, "1f1b", "default, 4 micro-batches, 1F1B", 5),
])
def test_a_circular_or_1f1b_layout_gathering_once_is_priced_by_its_schedule(
        virtual, schedule, settings, passes):
    """mesh.virtual_stages=2, or mesh.pipeline_schedule=1f1b (the config's, on every
    staged layout), with model.pipeline_gather_once: the compute is the chunk passes a
    stage runs (circular: V M + S - 1 ticks; 1F1B: M + S - 1 each way, over M + 2S - 2
    ticks) for V M of useful work, with every layer's forward run again (each chunk is
    rematerialised); the bound gathers the staged weights once and stays below the
    compiled step's bytes of every kind."""
    config = tiny_config(model={"n_layers": 4, "attn_impl": "dense",
                                "pipeline_gather_once": True},
                         train={"batch_size": 8, "seq_len": 64})
    config.mesh.virtual_stages = virtual
    config.mesh.pipeline_schedule = schedule
    layout = next(x for x in planner.layouts(config, 4, ["default"], 2, stages=[2])
                  if x.degrees == (2, 1, 2, 1, 1, 1))
    # make_plan hands the layouts typed settings, not the ConfigDict.
    assert planner.layouts(as_settings(config), 4, ["default"], 2, stages=[2]) == \
        planner.layouts(config, 4, ["default"], 2, stages=[2])
    assert (layout.virtual_stages, layout.microbatches) == (virtual, 4)
    assert layout.settings == settings
    assert layout.schedule.passes == passes
    assert layout.schedule.bubble == pytest.approx(1 / passes)
    checked = planner.check(config, layout, jax.devices()[:4], H100, devices_per_node=2)
    cfg = checked.settings.model
    head = 6 * cfg.dim * cfg.vocab_size * checked.tokens
    model_cfg = model_config(checked.settings.model, platform="gpu")
    forward = sum(roofline.recomputed_forward_flops(model_cfg, 64, "full").values())
    assert checked.recompute_flops == pytest.approx(forward * checked.tokens)
    assert checked.executed_flops == pytest.approx(
        (checked.model_flops + checked.recompute_flops - head) * passes / (4 * virtual)
        + 2 * head)
    cand = planner.Candidate(layout)
    planner._fill(cand, planner.measure(checked.config.to_json(sort_keys=True), 4), checked,
                  H100, 2, 1e12)
    assert cand.status == "ranked", cand.reason
    for kind in ("all-gather", "reduce-scatter", "all-reduce", "collective-permute"):
        least = sum(getattr(checked.least_link, side).get(kind, 0) for side in
                    ("inside", "across"))
        compiled = sum(getattr(cand.link, side).get(kind, 0) for side in ("inside", "across"))
        assert least <= compiled * (1 + 1e-9), (kind, least, compiled)


def test_traffic_splits_by_the_nodes_a_group_spans():
    records = [dict(kind="all-gather", ring_bytes=100.0, executed=2, groups=[[0, 1], [2, 3]]),
               dict(kind="all-reduce", ring_bytes=10.0, executed=3, groups=[[0, 2], [1, 3]]),
               dict(kind="all-reduce", ring_bytes=0.0, executed=9, groups=[[0, 3]])]
    link = roofline.traffic(records, devices_per_node=2)
    assert link.inside == {"all-gather": 200.0} and link.across == {"all-reduce": 30.0}
    e = roofline.estimate(H100, link, model_flops=4 * 989e12, tokens=1000, devices=4,
                          remat="full")
    # remat=full priced at what it reruns in Llama 3 8B (no model figure given).
    assert e.compute_s == pytest.approx(roofline.recompute_factor("full"))
    assert e.inside_s == pytest.approx(200 / 450e9)
    assert e.across_s == pytest.approx(30 / 50e9)
    assert e.serial_s == pytest.approx(e.compute_s + e.communication_s)
    assert e.mfu() == pytest.approx(1.0 / e.serial_s)


def _cli(*args, tmp_path):
    return subprocess.run(
        [sys.executable, "-m", "ndjax", "plan", "--config=configs/llama_fsdp.py",
         "--config.model.vocab_size=256", "--config.model.dim=64", "--config.model.n_layers=2",
         "--config.model.ffn_dim=128", "--config.train.seq_len=64",
         "--config.data.source=synthetic", "--workers=0", f"--cache_dir={tmp_path}", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_cli_json_lists_every_layout(tmp_path):
    r = _cli("--devices=2", "--rules=default", "--config.train.batch_size=1", "--json",
             tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert len(rows) == 5  # replica, fsdp, tensor; context with the ring and all-to-all
    assert {row["status"] for row in rows} == {"ranked", "rejected"}
    for row in rows:
        if row["status"] == "ranked":
            assert row["memory_bytes"] == row["arguments_bytes"] + row["temporaries_bytes"] > 0
            assert row["tokens_per_s"] > 0 and 0 < row["mfu"] < 1
        else:
            assert "is not divisible by 2" in row["reason"]


@pytest.mark.parametrize("args, message", [
    (("--devices=2", "--hardware=tpu"), "--hardware='tpu': choose one of"),
    (("--devices=0",), "--devices=0 must be >= 1"),
    (("--devices=16", "--stages=1,2"), "--stages='1,2': use off, auto or stage counts >= 2"),
    (("--devices=2", "--config.model.dtype=float8"), "model.dtype='float8'"),
])
def test_cli_bad_input_is_one_line(args, message, tmp_path):
    r = _cli(*args, tmp_path=tmp_path)
    assert r.returncode == 2
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("ndjax plan: error:") and message in r.stderr


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has ended: only its exit status is left)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def _is_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"spawn_main" in f.read()  # multiprocessing's spawn start method
    except OSError:
        return False


def _wait_until(condition, timeout_s: float) -> bool:
    """Polls ``condition`` until it holds or ``timeout_s`` passes (a bound, not a timing)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL],
                         ids=lambda s: s.name)
def test_stopped_planner_ends_its_workers(signum, tmp_path):
    """SIGTERM (timeout, SLURM), SIGINT (Ctrl-C) or SIGKILL of the planner ends its compile
    workers too: they once compiled on for an hour after ``timeout`` ended the planner."""
    from ndjax.runtime.children import children

    cmd = [sys.executable, "-m", "ndjax", "plan", "--config=configs/llama_fsdp.py",
           "--config.model.vocab_size=256", "--config.model.dim=64",
           # 96 unrolled layers: a compile takes minutes, as a real model's does, so
           # that a planner which waits for the running compiles (what SIGINT did) fails.
           "--config.model.n_layers=96", "--config.model.scan_layers=False",
           "--config.model.ffn_dim=128",
           "--config.train.seq_len=64", "--config.train.batch_size=2",
           "--config.data.source=synthetic", "--devices=2", "--rules=default",
           "--compiler=cpu", "--workers=2", "--cache_dir="]
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
    workers: list[int] = []
    try:
        # Both workers, started once the first layouts are sent to be compiled (beside
        # them: multiprocessing's resource tracker, which must end too).
        def started() -> bool:
            workers[:] = children(proc.pid)
            return proc.poll() is not None or sum(_is_worker(p) for p in workers) == 2
        assert _wait_until(started, 120) and proc.poll() is None, (
            workers, (tmp_path / "stderr").read_text()[-3000:])
        proc.send_signal(signum)
        try:
            status = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the planner did not exit within 30 s of {signum.name}")
        assert status == -signum  # it dies of the signal, as it would without a handler
        left = lambda: [p for p in workers if _alive(p)]  # noqa: E731
        assert _wait_until(lambda: not left(), 30), (
            f"workers {left()} outlived the planner", (tmp_path / "stderr").read_text()[-3000:])
    finally:
        for pid in [proc.pid, *workers]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


def test_mesh_auto_trains_on_the_planners_best_layout(tmp_path, monkeypatch, capsys):
    """mesh.auto=True: the run plans its devices (here 2 CPU devices, priced as H100s) as
    ndjax plan --top=1 does, trains on the best layout, says so on its start-up lines and
    records it as the run's config; the same config on the same devices then takes it
    from the plan cache. (That the best is ndjax plan's first: make_plan's tests.) Other
    commands refuse mesh.auto, in one line."""
    from ndjax.planning import auto
    from ndjax.training.loop import train

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config = tiny_config(train={"steps": 1, "batch_size": 2, "seq_len": 64})
    config.mesh.auto = True
    devices = jax.devices()[:2]
    records = train(config, str(tmp_path / "run"), devices)
    assert math.isfinite(records[-1]["loss"])
    out, err = capsys.readouterr()
    assert "train.py: mesh.auto: compiling" in err
    note = next(line for line in out.splitlines() if "mesh.auto:" in line)
    assert f"layouts for 2 cpu devices priced as {H100.name}, " in note
    saved = json.load(open(tmp_path / "run" / "config.json"))
    chosen = planner.Layout(**{a: saved["mesh"][a] for a in
                               ("replica", "fsdp", "context", "tensor", "expert")},
                            rules=saved["rules"], remat=saved["model"]["remat"],
                            grad_accum=saved["train"]["grad_accum"],
                            cp_impl=saved["model"]["cp_impl"])
    assert saved["mesh"]["auto"] is False and chosen.mesh != "1 device"
    assert f"mesh.auto: {chosen.mesh} [{chosen.settings}], remat {chosen.remat}" in note
    again, cached = auto.resolve(config, devices)
    assert cached == note + "; from the plan cache" and "compiling" not in capsys.readouterr().err
    assert again.mesh.to_dict() == saved["mesh"] and again.rules == saved["rules"]

    with pytest.raises(ConfigError, match=r"mesh.auto=True: train.py plans the layout"):
        Experiment.from_config(config, devices)
