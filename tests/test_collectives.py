# ruff: noqa: E501  (the HLO module below keeps XLA's one-line instructions)
"""ndjax.parallel.collectives: every collective of a compiled step, with bytes, groups and
executions per step, on a hand-made HLO module (exact answers known) and on
real compiled tiny steps (counts that must scale with the layer scan)."""

import pytest
from conftest import tiny_config

from ndjax.experiment import Experiment
from ndjax.ops.ring_attention import expected_collective_permutes
from ndjax.parallel.collectives import (
    LOWERED_RS,
    Collective,
    collectives,
    in_conditionals,
    summarize,
)

# A while loop (4 trips) whose body all-gathers a bf16 weight over iota groups and
# calls a computation that all-reduces an f32 gradient and keeps 1/4 of it through
# a fused dynamic-slice (the CPU's reduce-scatter); an async collective-permute
# over two rings of 4 in the entry.
HLO = """\
HloModule jit_step, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%shard (p0: f32[64,16], p1: s32[]) -> f32[16,16] {
  %p0 = f32[64,16]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %ds = f32[16,16]{1,0} dynamic-slice(%p0, %p1, %zero), dynamic_slice_sizes={16,16}
}

%reduce_grad (g: f32[64,16], i: s32[]) -> f32[16,16] {
  %g = f32[64,16]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %ar = f32[64,16]{1,0} all-reduce(%g), channel_id=2, replica_groups={{0,2,4,6},{1,3,5,7}}, use_global_device_ids=true, to_apply=%add
  ROOT %f = f32[16,16]{1,0} fusion(%ar, %i), kind=kLoop, calls=%shard
}

%body (t: (s32[], bf16[16,16], f32[64,16])) -> (s32[], bf16[16,16], f32[64,16]) {
  %t = (s32[], bf16[16,16]{1,0}, f32[64,16]{1,0}) parameter(0)
  %n = s32[] get-tuple-element(%t), index=0
  %w = bf16[16,16]{1,0} get-tuple-element(%t), index=1
  %g.1 = f32[64,16]{1,0} get-tuple-element(%t), index=2
  %ag = bf16[64,16]{1,0} all-gather(%w), channel_id=1, replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}, use_global_device_ids=true
  %c = f32[16,16]{1,0} call(%g.1, %n), to_apply=%reduce_grad
  ROOT %out = (s32[], bf16[16,16]{1,0}, f32[64,16]{1,0}) tuple(%n, %w, %g.1)
}

%cond (t.1: (s32[], bf16[16,16], f32[64,16])) -> pred[] {
  %t.1 = (s32[], bf16[16,16]{1,0}, f32[64,16]{1,0}) parameter(0)
  %k = s32[] get-tuple-element(%t.1), index=0
  %four = s32[] constant(4)
  ROOT %lt = pred[] compare(%k, %four), direction=LT
}

ENTRY %main (x: f32[8,4], w.1: bf16[16,16], g.2: f32[64,16]) -> f32[8,4] {
  %x = f32[8,4]{1,0} parameter(0)
  %w.1 = bf16[16,16]{1,0} parameter(1)
  %g.2 = f32[64,16]{1,0} parameter(2)
  %z = s32[] constant(0)
  %init = (s32[], bf16[16,16]{1,0}, f32[64,16]{1,0}) tuple(%z, %w.1, %g.2)
  %loop = (s32[], bf16[16,16]{1,0}, f32[64,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %cps = (f32[8,4]{1,0}, f32[8,4]{1,0}, u32[], u32[]) collective-permute-start(%x), channel_id=3, source_target_pairs={{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}
  ROOT %cpd = f32[8,4]{1,0} collective-permute-done(%cps)
}
"""


def test_hand_made_module():
    cs = {c.kind: c for c in collectives(HLO)}
    fsdp = ((0, 2, 4, 6), (1, 3, 5, 7))
    assert cs == {
        # bf16[64,16]: the gathered result
        "all-gather": Collective("all-gather", "bf16", 64 * 16 * 2, 4, fsdp, 4, None, "ag"),
        # f32[64,16] reduced over 4 devices, each keeping a quarter
        "reduce-scatter": Collective("reduce-scatter", "f32", 16 * 16 * 4, 4, fsdp, 4,
                                     LOWERED_RS, "ar"),
        # the start/done pair counts once, with the done's shape
        "collective-permute": Collective("collective-permute", "f32", 8 * 4 * 4, 4,
                                         ((0, 1, 2, 3), (4, 5, 6, 7)), 1, None, "cps"),
    }
    assert summarize(cs.values())["reduce-scatter"] == dict(
        static=1, executed=4, bytes=4 * 1024, ring_bytes=4 * 3 * 1024)


def test_a_whole_consumer_keeps_an_all_reduce():
    """The same all-reduce, also read whole, is no reduce-scatter."""
    hlo = HLO.replace("ROOT %f = f32[16,16]{1,0} fusion(%ar, %i), kind=kLoop, calls=%shard",
                      "%f = f32[16,16]{1,0} fusion(%ar, %i), kind=kLoop, calls=%shard\n"
                      "  ROOT %whole = f32[64,16]{1,0} add(%ar, %ar)")
    (ar,) = [c for c in collectives(hlo) if c.name == "ar"]
    assert (ar.kind, ar.bytes, ar.executed, ar.lowered_from) == ("all-reduce", 4096, 4, None)


def test_collectives_inside_a_conditional():
    """The all-gather a conditional's branch reaches through a call is inside it; the
    entry's collective-permute and the loop's all-gather are not."""
    hlo = HLO.replace("""  ROOT %cpd = f32[8,4]{1,0} collective-permute-done(%cps)""",
                      """  %cpd = f32[8,4]{1,0} collective-permute-done(%cps)
  %p = pred[] constant(true)
  ROOT %if = f32[8,4]{1,0} conditional(%p, %cpd, %cpd), true_computation=%gathers, false_computation=%same""")
    hlo = hlo.replace("ENTRY %main", """%inner (y: f32[2,4]) -> f32[8,4] {
  %y = f32[2,4]{1,0} parameter(0)
  ROOT %ag.1 = f32[8,4]{1,0} all-gather(%y), channel_id=4, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, use_global_device_ids=true
}

%gathers (u: f32[8,4]) -> f32[8,4] {
  %u = f32[8,4]{1,0} parameter(0)
  %s = f32[2,4]{1,0} slice(%u), slice={[0:2], [0:4]}
  ROOT %r = f32[8,4]{1,0} call(%s), to_apply=%inner
}

%same (u.1: f32[8,4]) -> f32[8,4] {
  ROOT %u.1 = f32[8,4]{1,0} parameter(0)
}

ENTRY %main""")
    assert {c.name for c in collectives(hlo)} == {"ag", "ar", "cps", "ag.1"}
    assert in_conditionals(hlo) == {"ag.1"}


@pytest.mark.parametrize("groups, expected", [
    ("{}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
    ("{{0,1},{2,3},{4,5},{6,7}}", ((0, 1), (2, 3), (4, 5), (6, 7))),
    ("[4,2]<=[8]", ((0, 1), (2, 3), (4, 5), (6, 7))),
    ("[2,4]<=[4,2]T(1,0)", ((0, 2, 4, 6), (1, 3, 5, 7))),
    ("[4,2]<=[2,4]T(1,0)", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("mesh['a'=4,'b'=2] {'a'}", ((0, 2, 4, 6), (1, 3, 5, 7))),
    ("mesh['a'=4,'b'=2,'c'=1] {'b'}", ((0, 1), (2, 3), (4, 5), (6, 7))),
    ("mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'b'}", ((0, 2, 4, 6), (1, 3, 5, 7))),
    ("mesh['a'=8] {'a':(2)2}", ((0, 2), (1, 3), (4, 6), (5, 7))),
])
def test_replica_group_forms(groups, expected):
    hlo = ("HloModule m, num_partitions=8\n\nENTRY %main (x: f32[4]) -> f32[4] {\n"
           "  %x = f32[4]{0} parameter(0)\n"
           f"  ROOT %ar = f32[4]{{0}} all-reduce(%x), replica_groups={groups}, "
           "use_global_device_ids=true, to_apply=%add\n}\n")
    (c,) = collectives(hlo)
    assert (c.groups, c.group_size, c.bytes, c.executed) == (expected, len(expected[0]), 16, 1)


def _step_collectives(mesh: dict, **model) -> list[Collective]:
    exp = Experiment.from_config(tiny_config(mesh=mesh, model=model))
    return collectives(exp.compiled_step.as_text())


def test_fsdp_x_tensor_counts_scale_with_layers():
    by_layers = {n: _step_collectives(dict(fsdp=4, tensor=2), n_layers=n, scan_layers=True)
                 for n in (2, 4)}
    two = by_layers[2]
    assert any(c.kind == "all-gather" and c.group_size == 4 for c in two)
    assert any(c.kind in ("all-reduce", "reduce-scatter") and c.group_size == 4 for c in two)
    assert any(c.kind == "reduce-scatter" and c.lowered_from == LOWERED_RS for c in two)
    # The same instructions (the scan body is compiled once), each run once per
    # step or once per layer.
    for n, cs in by_layers.items():
        assert {c.executed for c in cs} == {1, n}, (n, [(c.name, c.executed) for c in cs])

    def shape(cs, n):
        return sorted((c.kind, c.dtype, c.bytes, c.group_size, c.executed // n if c.executed > 1
                       else 0) for c in cs)
    assert shape(by_layers[2], 2) == shape(by_layers[4], 4)
    s2, s4 = summarize(by_layers[2]), summarize(by_layers[4])
    for kind in s2:
        assert s2[kind]["static"] == s4[kind]["static"], kind
    # Every all-gather here is a per-layer parameter gather but the embedding's.
    per_layer = sum(c.executed > 1 for c in two if c.kind == "all-gather")
    assert s4["all-gather"]["executed"] - s2["all-gather"]["executed"] == 2 * per_layer


def test_context_parallel_permutes_match_the_design():
    n_layers, context = 2, 2
    cs = [c for c in _step_collectives(dict(fsdp=4, context=context), attn_impl="ring")
          if c.kind == "collective-permute"]
    per_call = sum(expected_collective_permutes(context).values())
    hops = context - 1
    floats = sum(c.executed for c in cs if not c.dtype.startswith("s"))
    ints = sum(c.executed for c in cs if c.dtype.startswith("s"))
    # Keys/values and their gradients: all of the design's hops but the segment
    # ids' (c-1 each way), which XLA may hoist out of the layer loop or share.
    assert floats == n_layers * (per_call - 2 * hops)
    assert 0 < ints <= n_layers * 2 * hops
    assert all(c.group_size == context for c in cs)


WIDENED = """\
HloModule jit_step, num_partitions=4

ENTRY %main (w: bf16[16,16], g: f32[16,16]) -> (f32[64,16], f32[64,16]) {
  %w = bf16[16,16]{1,0} parameter(0)
  %g = f32[16,16]{1,0} parameter(1)
  %cv = f32[16,16]{1,0} convert(%w)
  %ag = f32[64,16]{1,0} all-gather(%cv), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}, use_global_device_ids=true
  %ag.1 = f32[64,16]{1,0} all-gather(%g), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}, use_global_device_ids=true
  ROOT %out = (f32[64,16]{1,0}, f32[64,16]{1,0}) tuple(%ag, %ag.1)
}
"""


def test_a_widened_bf16_collective_moves_bf16_bytes():
    """The CPU compiler gathers bf16 weights as f32 (a convert feeds the collective);
    a GPU moves the bf16 values, and so do the wire and ring bytes."""
    widened, f32 = collectives(WIDENED)
    assert widened.bytes == f32.bytes == 64 * 16 * 4
    assert widened.moved_bytes == 64 * 16 * 2 and f32.moved_bytes == 64 * 16 * 4
    assert widened.ring_bytes == pytest.approx(3 / 4 * 64 * 16 * 2)
    assert f32.wire_bytes is None
    # XLA:GPU's text moves what it says: there the convert is the program's own.
    assert all(c.moved_bytes == 64 * 16 * 4 for c in collectives(WIDENED, cpu_compiled=False))


# Expert parallelism's exchange over 4 devices: the dispatch sends a device's 256
# (token, expert) rows into a receive buffer sized for all 4 devices' rows (1024); the
# return sends that buffer back into 256 rows. One async, one synchronous.
RAGGED = """\
HloModule jit_step, is_scheduled=true, num_partitions=4

ENTRY %main (rows: bf16[256,64], sizes: s64[4]) -> bf16[256,64] {
  %rows = bf16[256,64]{1,0} parameter(0)
  %sizes = s64[4]{0} parameter(1)
  %big = bf16[1024,64]{1,0} broadcast(%rows), dimensions={}
  %small = bf16[256,64]{1,0} broadcast(%rows), dimensions={}
  %go = ((bf16[256,64]{1,0}, bf16[1024,64]{1,0}, s64[4]{0}, s64[4]{0}, s64[4]{0}, /*index=5*/s64[4]{0}), bf16[1024,64]{1,0}) ragged-all-to-all-start(%rows, %big, %sizes, %sizes, %sizes, /*index=5*/%sizes), channel_id=1, replica_groups={{0,1,2,3}}
  %got = bf16[1024,64]{1,0} ragged-all-to-all-done(%go)
  ROOT %back = bf16[256,64]{1,0} ragged-all-to-all(%got, %small, %sizes, %sizes, %sizes, /*index=5*/%sizes), channel_id=2, replica_groups={{0,1,2,3}}
}
"""


def test_a_ragged_all_to_all_counts_the_rows_a_device_has():
    """Both directions count 256 rows of 64 bf16 (not the 1024-row worst-case buffer),
    of which balanced routing sends 3/4 to the other devices."""
    go, back = collectives(RAGGED)
    for c in (go, back):
        assert (c.kind, c.bytes, c.lowered_from) == ("all-to-all", 256 * 64 * 2,
                                                     "ragged-all-to-all")
        assert c.ring_bytes == pytest.approx(3 / 4 * 256 * 64 * 2)
    assert (go.name, back.name) == ("go", "back")
