"""Pipeline parallelism (mesh.stage, ndjax.parallel.pipeline): GPipe, circular and 1F1B
over 2 and 4 stages, alone and with every other axis, train like one device; checkpoints
move between stage counts and schedules; the schedules' bubbles and held activations
are the programs'; bad input is one line.

Tolerances as tests/test_layouts.py (helpers.assert_same_training): 3 AdamW steps' losses
at rtol 1e-5, the first step's gradients within 1e-5 of each parameter's largest. What is
not checked here: speed, and GPU kernels inside stages (the GPU compile of a pipelined
step is tests/test_gpu_compile.py's).
"""

import shutil

import jax
import numpy as np
import pytest
from conftest import tiny_config
from data_files import chat_overrides
from helpers import assert_same_training, with_overrides
from test_checkpoint import logged_steps, losses_by_step

from ndjax.experiment import Experiment
from ndjax.parallel import pipeline, rules
from ndjax.parallel.collectives import collectives
from ndjax.runtime.errors import ConfigError
from ndjax.training.loop import train
from ndjax.verbs import generate

FOUR = dict(n_layers=4)
MOE = dict(family="qwen3_moe", head_dim=16, n_experts=4, experts_per_token=2, moe_ffn_dim=32)
# DeepSeek V3 at the tiny config's width (MLA, sigmoid group-limited routing, a shared
# expert, the load-balancing bias moving, one dense first layer); its dense layer runs
# before the stages, which cut the other n_layers - 1.
DEEPSEEK = dict(family="deepseek_v3", n_kv_heads=8, head_dim=16, rope_head_dim=8,
                v_head_dim=12, q_lora_rank=24, kv_lora_rank=16, n_experts=4,
                experts_per_token=2, moe_ffn_dim=32, shared_expert_dim=32, first_k_dense=1,
                n_group=2, topk_group=1, score_bias_rate=0.01)
LORA = {"lora": {"rank": 4, "alpha": 16.0}}
QLORA = {"lora": {"rank": 4, "alpha": 16.0, "quantize": "nf4", "quant_block": 8}}

# name: (mesh, model, overrides, devices). Batches of 8 rows.
LAYOUTS = {
    # 2 micro-batches (mesh.stage's default) of 4 rows.
    "stage2": (dict(stage=2), {}, {}, 2),
    # More micro-batches than stages, each layer's input kept and recomputed, and
    # grad_accum slices each run through the pipeline.
    "stage4_fsdp2_full_remat_grad_accum": (
        dict(stage=4, fsdp=2), {**FOUR, "remat": "full"},
        {"train.grad_accum": 2, "train.microbatches": 2}, 8),
    # LoRA dropout's masks follow each token and layer through the micro-batches.
    "stage2_fsdp2_tensor2_lora_dropout": (
        dict(stage=2, fsdp=2, tensor=2), {"lora": {**LORA["lora"], "dropout": 0.1}}, {}, 8),
    # Packed chat rows (documents and padding) through ring attention inside the stages.
    "stage2_fsdp2_context2_ring_chat": (dict(stage=2, fsdp=2, context=2), {}, "chat", 8),
    "stage2_context2_tensor2_all_to_all_qlora": (
        dict(stage=2, context=2, tensor=2), {**QLORA, "cp_impl": "all_to_all"}, {}, 8),
    # The experts' exchange (a shard_map over the data axes and the experts' width)
    # inside the stages, with the router's load-balancing loss summed over
    # micro-batches; each layer recomputed in the full remat scan's custom VJP, whose
    # backward rule differentiates that shard_map under the stages' vmap.
    "stage2_expert2_tensor2_moe_full_remat": (dict(stage=2, expert=2, tensor=2),
                                              {**MOE, "remat": "full"}, {}, 8),
    # The circular schedule: 8 layers in 4 chunks of 2, stage 0 holding layers 0-1 and
    # 4-5; each micro-batch goes round the 2 stages twice.
    "stage2_virtual2": (dict(stage=2, virtual_stages=2), dict(n_layers=8), {}, 2),
    # 3 chunks a stage, more micro-batches than stages (the last stage's output waits a
    # tick for stage 0), with fsdp, tensor and LoRA.
    "stage2_virtual3_fsdp2_tensor2_lora": (
        dict(stage=2, virtual_stages=3, fsdp=2, tensor=2), {**LORA, "n_layers": 6},
        {"train.microbatches": 4}, 8),
    # 4 stages of 2 chunks, the experts' exchange inside them.
    "stage4_virtual2_expert2_moe": (dict(stage=4, virtual_stages=2, expert=2),
                                    {**MOE, "n_layers": 8}, {"train.microbatches": 4}, 8),
    # Ring attention over MLA inside the chunks, and the load-balancing biases moving by
    # counts that come back in the stored order, as the biases are stored.
    "stage2_virtual2_context2_expert2_deepseek": (
        dict(stage=2, virtual_stages=2, context=2, expert=2), {**DEEPSEEK, "n_layers": 5},
        {}, 8),
    # Each stage's layers gathered over fsdp once per step (model.pipeline_gather_once).
    "stage2_fsdp2_tensor2_gather_once": (dict(stage=2, fsdp=2, tensor=2),
                                         {"pipeline_gather_once": True}, {}, 8),
    "stage2_virtual2_fsdp4_gather_once_lora": (
        dict(stage=2, virtual_stages=2, fsdp=4), {**LORA, "n_layers": 4,
                                                  "pipeline_gather_once": True}, {}, 8),
    "stage2_fsdp2_expert2_moe_gather_once_grad_accum": (
        dict(stage=2, fsdp=2, expert=2), {**MOE, "pipeline_gather_once": True},
        {"train.grad_accum": 2, "train.batch_size": 16}, 8),
    # 1F1B: each tick a forward and an earlier micro-batch's backward on every stage, the
    # loss formed per micro-batch on the last stage. 2 stages, 4 micro-batches: more than
    # the 2S - 1 = 3 a stage holds, so the slots of its kept inputs are reused.
    "stage2_1f1b": (dict(stage=2, pipeline_schedule="1f1b"), {},
                    {"train.microbatches": 4}, 2),
    # Tied embeddings: the table's gradient is the embedding's, formed per micro-batch on
    # stage 0, plus the LM head's, formed on the last stage inside the pipeline.
    "stage2_fsdp2_1f1b_tied_embeddings": (dict(stage=2, fsdp=2, pipeline_schedule="1f1b"),
                                          {"tie_embeddings": True},
                                          {"train.microbatches": 4}, 4),
    # 4 stages (every slot used once), fsdp inside them, each layer recomputed inside a
    # chunk's backward.
    "stage4_fsdp2_1f1b_remat": (dict(stage=4, fsdp=2, pipeline_schedule="1f1b"),
                                {**FOUR, "remat": "full"}, {"train.microbatches": 4}, 8),
    # The adapters alone differentiated (the frozen base's gradients never formed), LoRA
    # dropout's masks, tensor parallelism, the layers gathered once a step.
    "stage2_fsdp2_tensor2_1f1b_lora_dropout_gather_once": (
        dict(stage=2, fsdp=2, tensor=2, pipeline_schedule="1f1b"),
        {"lora": {**LORA["lora"], "dropout": 0.1}, "pipeline_gather_once": True},
        {"train.microbatches": 4}, 8),
    # Packed chat rows through ring attention; the loss's tokens counted per micro-batch.
    "stage2_fsdp2_context2_ring_chat_1f1b": (
        dict(stage=2, fsdp=2, context=2, pipeline_schedule="1f1b"), {}, "chat", 8),
    # DeepSeek V3: ring attention over MLA and the experts' exchange inside the stages,
    # the load-balancing biases moving by the counts of the forward ticks.
    "stage2_context2_expert2_1f1b_deepseek": (
        dict(stage=2, context=2, expert=2, pipeline_schedule="1f1b"),
        {**DEEPSEEK, "n_layers": 3}, {"train.grad_accum": 2, "train.batch_size": 16}, 8),
    # The dense first layer on every stage's devices, then 4 MoE layers over 2 stages; the
    # load-balancing biases move by the per-layer counts the stages return in layer order.
    "stage2_fsdp2_expert2_deepseek": (dict(stage=2, fsdp=2, expert=2),
                                      {**DEEPSEEK, "n_layers": 3}, {}, 8),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_stages_train_like_one_device(cpu_devices, tmp_path, layout):
    mesh, model, overrides, devices = LAYOUTS[layout]
    if overrides == "chat":
        overrides = chat_overrides(tmp_path)
    config = with_overrides(tiny_config(mesh=mesh, model=model), overrides)
    exp = Experiment.from_config(config, cpu_devices[:devices])
    assert exp.model_cfg.stages == mesh["stage"]
    # The layers' parameters are split over the stages, contiguously; nothing else is.
    assert exp.state_sharding.params["layers"]["attn_norm"]["scale"].spec[0] == "stage"
    assert "stage" not in str(exp.state_sharding.params["embed"].spec)
    if "dense_layers" in exp.state_sharding.params:  # on every stage, as the embedding
        dense = jax.tree.leaves(exp.state_sharding.params["dense_layers"])
        assert dense and all("stage" not in str(s.spec) for s in dense)
    # The one-device reference has no stages to gather once.
    reference = {k: v for k, v in model.items() if k != "pipeline_gather_once"}
    assert_same_training(exp, reference, overrides or None)


def test_checkpoints_move_between_stage_counts(tmp_path):
    """Saved at step 2 on 4 stages (x fsdp 2), resumed on 2 stages (GPipe and 1F1B), on 2
    stages of 2 chunks each (the circular schedule's stored order) and on none: steps 3 to 5 are
    the uninterrupted run's. The circular run's own step-4 checkpoint (saved in layer
    order) resumes on no stages for step 5. ``ndjax generate`` decodes such a run
    without stages."""
    def run_config(mesh):
        c = tiny_config(mesh=mesh, model=FOUR, train=dict(steps=5))
        c.checkpoint.every = 2
        c.log.tensorboard = False
        return c

    config = run_config(dict(stage=4, fsdp=2))
    source = tmp_path / "stage4"
    train(config, str(source), verbose=False)
    reference = losses_by_step(logged_steps(str(source)))

    def resume(mesh, name, checkpoints, step):
        workdir = tmp_path / name
        shutil.copytree(checkpoints, workdir / "checkpoints")
        other = run_config(mesh)
        other.checkpoint.resume = str(step)
        records = train(other, str(workdir), verbose=False)
        assert [r["step"] for r in records] == list(range(step + 1, 6)), mesh
        # Another layout sums in another order: f32 losses at the suite's rtol 1e-5.
        np.testing.assert_allclose([r["loss"] for r in records],
                                   [reference[s] for s in range(step + 1, 6)],
                                   rtol=1e-5, err_msg=str(mesh))
        return workdir

    resume(dict(stage=2, fsdp=4), "stage2", source / "checkpoints", 2)
    resume(dict(stage=2, fsdp=4, pipeline_schedule="1f1b"), "1f1b", source / "checkpoints", 2)
    circular = resume(dict(stage=2, virtual_stages=2, fsdp=4), "circular",
                      source / "checkpoints", 2)
    resume(dict(fsdp=8), "none", source / "checkpoints", 2)
    resume(dict(fsdp=8), "none_from_circular", circular / "checkpoints", 4)
    # Generation runs no pipeline: the stages' devices shard the weights over fsdp.
    decode = generate.for_generation(run_config(dict(stage=2, virtual_stages=2, fsdp=4)), 8)
    assert (decode.mesh.stage, decode.mesh.virtual_stages, decode.mesh.fsdp) == (1, 1, 8)


def test_the_bubble_and_the_activations_held_are_the_programs(cpu_devices):
    """GPipe's bubble is (S - 1) / (M + S - 1); the step's saved activations (remat=full:
    each layer's input) are those of M + S - 1 ticks, each stage one micro-batch a tick:
    GPipe's M micro-batches and the bubble's S - 1 ticks, which the scan saves too. The
    compiled step moves the stream between stages with collective permutes. The circular
    schedule's are (S - 1) / (V M + S - 1) and V M + S - 1 ticks of each chunk's input,
    which the backward pass runs again."""
    assert pipeline.GPipe(4, 8).bubble == 3 / 11
    assert pipeline.GPipe(2, 2).bubble == 1 / 3
    stages, micro = 4, 4
    exp = Experiment.from_config(tiny_config(mesh=dict(stage=stages, fsdp=2),
                                             model={**FOUR, "remat": "full"},
                                             train=dict(microbatches=micro)), cpu_devices)
    plan = pipeline.GPipe(stages, micro)
    batch = exp.abstract_batch
    rows, seq = batch["inputs"].shape[0] // micro, batch["inputs"].shape[1]

    def residuals(params, batch):
        def features(p):
            return exp.features(p, batch["inputs"], batch["positions"], batch["segment_ids"])[0]
        return jax.tree.leaves(jax.vjp(features, params)[1])

    with jax.set_mesh(exp.mesh), rules.use(exp.rules):
        saved = jax.eval_shape(residuals, exp.abstract_state.params, batch)
    dim = exp.model_cfg.dim
    # (ticks, a stage's layers, stages, a micro-batch's rows, seq, dim): the largest residual.
    biggest = max(saved, key=lambda a: a.size).shape
    assert biggest == (plan.ticks, 4 // stages, stages, rows, seq, dim), biggest

    hlo = exp.compiled_step.as_text()
    assert "collective-permute" in hlo

    # The circular schedule: V M + S - 1 ticks of a chunk of L / (S V) layers, and the
    # bubble V times smaller.
    assert pipeline.Circular(4, 8, 2).bubble == 3 / 19
    virtual = 2
    exp = Experiment.from_config(tiny_config(mesh=dict(stage=stages, fsdp=2,
                                                       virtual_stages=virtual),
                                             model={"n_layers": 8, "remat": "full"},
                                             train=dict(microbatches=micro)), cpu_devices)
    plan = pipeline.schedule(stages, micro, virtual)
    assert plan.ticks == virtual * micro + stages - 1
    with jax.set_mesh(exp.mesh), rules.use(exp.rules):
        saved = jax.eval_shape(residuals, exp.abstract_state.params, batch)
    # Each tick the chunks' inputs alone (ticks, stages, rows, seq, dim); the weights
    # once, (stages, virtual, a chunk's layers, ...), not once a tick.
    biggest = max(saved, key=lambda a: a.size).shape
    assert biggest == (plan.ticks, stages, rows, seq, dim), biggest
    per_tick = [a.shape for a in saved if a.shape[:1] == (plan.ticks,) and a.ndim > 2]
    assert all(shape[1:4] == (stages, rows, seq) for shape in per_tick), per_tick


def _scans(jaxpr) -> list[tuple[list[tuple[int, ...]], list[tuple[int, ...]]]]:
    """Each scan in ``jaxpr`` (nested ones too): (the shapes it carries from tick to
    tick, the shapes it stacks over its ticks)."""
    from jax.extend.core import jaxprs_in_params

    scans = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            body = eqn.params["jaxpr"].jaxpr
            if "num_consts" in eqn.params:
                first, n = eqn.params["num_consts"], eqn.params["num_carry"]
            else:  # jax 0.12: the (consts, carry, xs) trees of its inputs
                first, n, _ = (len(list(part.vals)) for part in eqn.params["ft_in"].unpack())
            scans.append(([v.aval.shape for v in body.invars[first:first + n]],
                          [v.aval.shape for v in eqn.outvars[n:]]))
        for sub in jaxprs_in_params(eqn.params):
            scans += _scans(sub)
    return scans


@pytest.mark.parametrize("stages, fsdp, micro", [(2, 1, 8), (4, 2, 4)])
def test_1f1b_holds_at_most_2s_minus_1_micro_batches(cpu_devices, stages, fsdp, micro):
    """The 1F1B step's program (its gradient's jaxpr): the ticks carry each stage's kept
    chunk inputs, min(M, 2S - 1) micro-batches of them, and the embedding's gradient
    (M micro-batches on stage 0, as GPipe's output buffer); nothing else shaped like
    micro-batches of activations crosses the ticks, and no tick's activations are
    stacked for a backward pass (the scans have none: the gradient is formed in them).
    GPipe's step at the same shapes saves (M + S - 1) ticks x its layers' inputs."""
    from ndjax.models.decoder import HeadLoss
    from ndjax.ops.cross_entropy import loss_sums

    def program(schedule):
        exp = Experiment.from_config(tiny_config(
            mesh=dict(stage=stages, fsdp=fsdp, pipeline_schedule=schedule),
            model={"n_layers": 8, "remat": "full"},
            train=dict(microbatches=micro, batch_size=16)), cpu_devices[:stages * fsdp])
        batch = exp.abstract_batch

        def loss(params, batch):
            head_loss = HeadLoss(lambda x, head, rows: loss_sums(x, head, *rows, 32),
                                 (batch["targets"], batch["loss_mask"]))
            (total, _), _ = exp.features(params, batch["inputs"], batch["positions"],
                                         batch["segment_ids"], head_loss=head_loss)
            return total

        with jax.set_mesh(exp.mesh), rules.use(exp.rules):
            return exp, jax.make_jaxpr(jax.grad(loss))(exp.abstract_state.params, batch)

    exp, jaxpr = program("1f1b")
    plan = pipeline.schedule(stages, micro, kind="1f1b")
    assert plan.held == min(micro, 2 * stages - 1)
    rows, seq, dim = 16 // micro, 32, exp.model_cfg.dim
    kept = (stages, plan.held, rows, seq, dim)
    embedding_grad = (stages, micro, rows, seq, dim)
    ticks = [scan for scan in _scans(jaxpr.jaxpr) if kept in scan[0]]
    assert ticks
    # The micro-batch buffers the ticks carry: the kept inputs and the embedding's
    # gradient (stage 0's slots), nothing else; and nothing stacked over the ticks.
    buffers = {shape for carried, _ in ticks for shape in carried
               if len(shape) == 5 and shape[0] == stages and shape[-3:] == (rows, seq, dim)}
    assert buffers == {kept, embedding_grad}, buffers
    assert all(not stacked for _, stacked in ticks), ticks
    assert plan.bubble == pipeline.GPipe(stages, micro).bubble == (stages - 1) / (
        micro + stages - 1)

    # GPipe's forward ticks stack each layer's input of every tick for the backward pass.
    _, jaxpr = program("gpipe")
    gpipe = pipeline.GPipe(stages, micro)
    saved = [shape for _, stacked in _scans(jaxpr.jaxpr) for shape in stacked
             if shape[-3:] == (rows, seq, dim)]
    assert (gpipe.ticks, 8 // stages, stages, rows, seq, dim) in saved, saved


def test_a_1f1b_eval_step_is_gpipes_forward(cpu_devices):
    """An eval step takes no gradient, so the 1F1B pipeline's custom VJP runs its primal:
    GPipe's forward, then the loss over the whole batch. Its loss is one device's."""
    from helpers import host_batches

    def eval_loss(mesh, devices, params=None):
        exp = Experiment.from_config(tiny_config(mesh=mesh, model=FOUR,
                                                 train=dict(microbatches=4)), devices)
        params = exp.init_state().params if params is None else jax.device_put(
            params, exp.state_sharding.params)
        batch = exp.device_batch(next(iter(host_batches(exp.config, 1))))
        return jax.device_get(params), float(exp.compiled_eval(params, batch)["loss"])

    params, one = eval_loss(dict(fsdp=1), cpu_devices[:1])
    _, staged = eval_loss(dict(stage=2, fsdp=2, pipeline_schedule="1f1b"), cpu_devices[:4],
                          params)
    np.testing.assert_allclose(staged, one, rtol=1e-5)


def test_gather_once_gathers_each_stages_layers_outside_the_ticks(cpu_devices):
    """model.pipeline_gather_once: every all-gather of the step runs once a step (the
    layers' weights, gathered over fsdp before the ticks); without it the layers'
    gathers run at every tick. The gradients' reductions are the same either way
    (each tick's, to the storage layout: the trains-like-one-device layouts above
    check their sums)."""
    def gathers(once):
        exp = Experiment.from_config(tiny_config(
            mesh=dict(stage=2, fsdp=4), model=dict(n_layers=4, pipeline_gather_once=once),
            train=dict(microbatches=2, batch_size=16)), cpu_devices)
        found = collectives(exp.compiled_step.as_text())
        reductions = sorted((c.kind, c.executed, c.bytes) for c in found
                            if c.kind in ("reduce-scatter", "all-reduce"))
        return [c for c in found if c.kind == "all-gather"], reductions

    per_tick, reductions = gathers(False)
    once, reductions_once = gathers(True)
    assert any(c.executed > 1 for c in per_tick)
    assert once and all(c.executed == 1 for c in once), [(c.name, c.executed) for c in once]
    assert sum(c.executed * c.bytes for c in once) < sum(c.executed * c.bytes for c in per_tick)
    assert reductions_once == reductions


def test_the_start_up_lines_name_the_schedule(cpu_devices, tmp_path):
    from ndjax.training import summary

    def line(mesh, model, train_=None):
        exp = Experiment.from_config(tiny_config(mesh=mesh, model=model, train=train_),
                                     cpu_devices)
        return [x for x in summary.startup(exp, str(tmp_path), None)
                if x.startswith("pipeline: ")]

    assert line(dict(stage=2, virtual_stages=2, fsdp=4), dict(n_layers=8)) == [
        "pipeline: Circular, 2 stages of 2 chunks of 2 layers each, taken in turn; 2 "
        "micro-batches per step: 5 ticks, 20% of them idle on each stage (the bubble)"]
    assert line(dict(stage=4, fsdp=2), FOUR, dict(grad_accum=2, microbatches=2)) == [
        "pipeline: GPipe, 4 stages of 1 layer each; 2 micro-batches per step per grad_accum "
        "slice: 5 ticks, 60% of them idle on each stage (the bubble)"]
    assert line(dict(stage=2, fsdp=2, tensor=2, pipeline_schedule="1f1b"), FOUR,
                dict(microbatches=4)) == [
        "pipeline: 1F1B, 2 stages of 2 layers each; 4 micro-batches per step: 6 ticks of a "
        "forward and a backward, the first and last 1 of one kind, 20% of the step idle on "
        "each stage (the bubble); a stage holds at most 3 micro-batches' activations"]
    assert line(dict(fsdp=8), {}) == []


@pytest.mark.parametrize("mesh, model, train_, message", [
    (dict(stage=3, fsdp=2), dict(n_layers=4), {},
     r"^mesh.stage=3 does not divide model.n_layers=4: .* Use mesh.stage in \[2, 4\]\.$"),
    (dict(stage=2, fsdp=4), dict(family="gemma3", n_layers=6, sliding_window=8), {},
     r"^mesh.stage=2 gives each stage 3 layers, not whole periods of the model's 6-layer "),
    (dict(stage=2, fsdp=4), {}, dict(microbatches=4),
     r"^train.microbatches=4: .* 8 must be a multiple of 4 x 4\. Use train.microbatches in "
     r"\[1, 2\]"),
    (dict(stage=2, fsdp=4), {**DEEPSEEK, "n_layers": 4}, {},
     r"^mesh.stage=2 does not divide the 3 MoE layers \(model.n_layers=4 less "
     r"model.first_k_dense=1, which run before the stages\): .* Use mesh.stage in \[3\]\.$"),
    (dict(fsdp=8, virtual_stages=2), {}, {},
     r"^mesh.virtual_stages=2 needs pipeline stages: .* Set mesh.stage > 1 or "),
    (dict(stage=2, fsdp=4, virtual_stages=3), dict(n_layers=4), {},
     r"^mesh.virtual_stages=3: 2 stages x 3 chunks do not divide model.n_layers=4: .* Use "
     r"mesh.virtual_stages in \[1, 2\]\.$"),
    (dict(stage=2, fsdp=4, virtual_stages=2), dict(family="gemma3", n_layers=12,
                                                    sliding_window=8), {},
     r"^mesh.stage=2 x mesh.virtual_stages=2 gives each chunk 3 layers, not whole periods "),
    (dict(stage=4, fsdp=2, virtual_stages=2), dict(n_layers=8), dict(microbatches=2),
     r"^train.microbatches=2 with mesh.stage=4, mesh.virtual_stages=2: .* Use "
     r"train.microbatches >= 4\.$"),
    (dict(fsdp=8), dict(pipeline_gather_once=True), {},
     r"^model.pipeline_gather_once=True needs pipeline stages: .* Set mesh.stage > 1 or "),
    (dict(stage=2, fsdp=4, virtual_stages=2), dict(n_layers=4), dict(objective="grpo"),
     r"^train.objective='grpo' with mesh.virtual_stages=2: GRPO samples from the train "
     r"state, .* not built yet\. Set mesh.virtual_stages=1\.$"),
    (dict(fsdp=8, pipeline_schedule="1f1b"), {}, {},
     r"^mesh.pipeline_schedule='1f1b' needs pipeline stages\. Set mesh.stage > 1 or "),
    (dict(stage=4, fsdp=2, pipeline_schedule="1f1b"), FOUR, dict(microbatches=2),
     r"^mesh.pipeline_schedule='1f1b' with train.microbatches=2 < mesh.stage=4: .* Use "
     r"train.microbatches >= 4\.$"),
    (dict(stage=2, fsdp=4, virtual_stages=2, pipeline_schedule="1f1b"), dict(n_layers=4),
     {}, r"^mesh.pipeline_schedule='1f1b' with mesh.virtual_stages=2: interleaved 1F1B "),
    (dict(stage=2, fsdp=4, pipeline_schedule="1f1b"), {}, dict(objective="dpo"),
     r"^mesh.pipeline_schedule='1f1b' with train.objective='dpo': .* Use "
     r"mesh.pipeline_schedule=gpipe\.$"),
    (dict(stage=2, fsdp=4, pipeline_schedule="1f1b"), {**MOE, "router_aux_loss_coef": 0.01},
     {}, r"^mesh.pipeline_schedule='1f1b' with the router's losses in the loss "
         r"\(model.router_aux_loss_coef=0.01, model.router_z_loss_coef=0.0\): "),
])
def test_bad_pipelines_are_one_line(cpu_devices, mesh, model, train_, message):
    with pytest.raises(ConfigError, match=message) as e:
        Experiment.from_config(tiny_config(mesh=mesh, model=model, train=train_),
                               cpu_devices[:6 if mesh.get("stage") == 3 else 8])
    assert "\n" not in str(e.value)


def test_hugging_face_files_in_and_out_of_the_circular_order(tmp_path):
    """model.init_from on 2 stages of 2 chunks each: the state holds the layers in the
    circular order (stage 0 layers 0 and 2, stage 1 layers 1 and 3), and train.py's
    steps=0 exports the file's weights unchanged (transformers loads them)."""
    from test_hf import assert_same_weights, config_for, make_hf
    from transformers import AutoModelForCausalLM

    model = make_hf(tmp_path / "hf", num_hidden_layers=4)
    c = config_for(tmp_path / "hf", dict(stage=2, virtual_stages=2, fsdp=4),
                   hf_dir=str(tmp_path / "out"), dtype="float32")
    exp = Experiment.from_config(c, jax.devices())
    stored = jax.device_get(exp.init_state().params["layers"]["mlp"]["w_down"])
    for position, layer in enumerate([0, 2, 1, 3]):
        np.testing.assert_array_equal(
            stored[position], model.model.layers[layer].mlp.down_proj.weight.detach().numpy().T)
    c.train.steps = 0
    c.log.tensorboard = False
    train(c, str(tmp_path / "w"), verbose=False)
    assert_same_weights(AutoModelForCausalLM.from_pretrained(tmp_path / "out"), model)
