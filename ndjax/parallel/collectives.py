"""Every collective of a compiled step, read from its optimized HLO text.

``collectives(compiled.as_text())`` lists each collective instruction once, with
its kind, result bytes per device, replica groups and how many times one step
executes it (the product of the known trip counts of the while loops around it).
This is what a layout planner needs to price a mesh's communication before any
GPU is rented; where the CPU backend's HLO is the input, its habits are undone
(XLA:GPU's, ``cpu_compiled=False``, is read as it is but for the async pairs):

- Async pairs (``all-gather-start``/``-done``, ``collective-permute-start``/...)
  are one collective: the start is listed, with the done's (result) shape.
- The CPU backend has no reduce-scatter: it emits an all-reduce whose result
  each device then cuts to its shard with a dynamic-slice (often fused into the
  consumer). A GPU compile makes that one reduce-scatter, so it is listed as
  ``kind="reduce-scatter"``, ``lowered_from="all-reduce+dynamic-slice"`` (see
  ``_scattered`` for the exact rule and its limits).

Bytes convention: ``Collective.bytes`` is the size of the operation's *result*
on one device: the gathered array for an all-gather, the shard for a
reduce-scatter, the whole array for an all-reduce, the received block for a
collective-permute or all-to-all. ``Collective.ring_bytes`` turns that into the
bytes each device sends with a ring algorithm.

A ragged all-to-all (expert parallelism's dispatch and return) is the exception: its
buffers are sized for the worst case (every row to one device), and only the rows
sent move. It is counted at the smaller of its send and receive buffers, the rows a
device has of its own to send or to get back (``lowered_from="ragged-all-to-all"``):
under balanced routing each device sends (g - 1)/g of them, which is what
``ring_bytes`` gives.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable

import numpy as np

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
LOWERED_RS = "all-reduce+dynamic-slice"

# Bits per element; sub-byte types round up per array (XLA packs them, but a
# planner does not care about half a byte).
_BITS = {"pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16,
         "f16": 16, "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64,
         "f64": 64, "c64": 64, "c128": 128}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\{$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of the step.

    kind: one of ``KINDS``. dtype: element type of the result (``f32+s32`` when a
    combined collective mixes types). bytes: result bytes per device (module doc).
    group_size / groups: devices per group and the groups (device ids); for a
    collective-permute the groups are the connected components of its
    source-target pairs (a ring of c devices is one group of c; a swap of pairs is
    groups of 2). executed: times one step runs it. lowered_from: the op read as
    ``kind``, where it is another: the CPU lowering of a reduce-scatter, or a
    ragged-all-to-all (counted at its send size, module doc). name: the HLO instruction.
    wire_bytes: ``bytes`` at the dtype the values had before the CPU compiler
    widened them: it runs 16-bit floats' collectives in float32 (the operand is a
    convert from bf16), where a GPU moves the 16-bit values. None: as ``bytes``.
    """

    kind: str
    dtype: str
    bytes: int
    group_size: int
    groups: tuple[tuple[int, ...], ...]
    executed: int
    lowered_from: str | None = None
    name: str = ""
    wire_bytes: int | None = None

    @property
    def moved_bytes(self) -> int:
        """Result bytes per device as a GPU moves them (``wire_bytes`` if widened)."""
        return self.bytes if self.wire_bytes is None else self.wire_bytes

    @property
    def ring_bytes(self) -> float:
        """Bytes one device sends per execution with a ring (or direct) algorithm."""
        g = self.group_size
        if g <= 1:
            return 0.0
        factor = {"all-gather": (g - 1) / g, "reduce-scatter": g - 1,
                  "all-reduce": 2 * (g - 1) / g, "collective-permute": 1,
                  "all-to-all": (g - 1) / g}[self.kind]
        return factor * self.moved_bytes


# ----- HLO text -> computations of instructions --------------------------------------------


@dataclasses.dataclass
class _Instr:
    name: str
    shape: str
    op: str
    operands: list[str]
    attrs: str
    args: str  # the text inside the parentheses: a parameter's index, a constant's value


def _closing(text: str, start: int) -> int:
    """Index just past the bracket that closes the one at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "({[":
            depth += 1
        elif text[i] in ")}]":
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced HLO line: {text[:200]}")


def _parse_instr(line: str) -> _Instr | None:
    m = _INSTR.match(line)
    if m is None:
        return None
    rest = line[m.end():]
    # A tuple shape has spaces and commas of its own: find its end by brackets.
    end = _closing(rest, 0) if rest.startswith("(") else rest.index(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    paren = rest.find("(")
    if paren < 0:
        return None
    op = rest[:paren]
    close = _closing(rest, paren)
    args = rest[paren + 1:close - 1]
    return _Instr(m.group(1), shape, op, re.findall(r"%([\w.\-]+)", args), rest[close:], args)


@dataclasses.dataclass
class _Module:
    comps: dict[str, list[_Instr]]
    entry: str
    devices: int



def _parse(hlo: str) -> _Module:
    comps: dict[str, list[_Instr]] = {}
    entry, name = None, None
    for line in hlo.splitlines():
        m = _HEADER.match(line)
        if m:
            name = m.group(2)
            comps[name] = []
            entry = name if m.group(1) else entry
        elif name is not None and (ins := _parse_instr(line)) is not None:
            comps[name].append(ins)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    counts = [int(x) for x in re.findall(r"\b(?:num_partitions|replica_count)=(\d+)",
                                         hlo.split("\n", 1)[0])]
    return _Module(comps, entry, int(np.prod(counts)) if counts else 1)


# ----- executed counts ---------------------------------------------------------------------


def _trip_count(ins: _Instr) -> int | None:
    m = re.search(r"backend_config=(\{.*\})", ins.attrs)
    if m is None:
        return None
    try:
        n = json.loads(m.group(1)).get("known_trip_count", {}).get("n")
    except json.JSONDecodeError:  # other attributes after the JSON
        n = (re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs) or [None, None])[1]
    return int(n) if n is not None else None


def _callees(ins: _Instr) -> list[tuple[str, str]]:
    """(attribute, computation) pairs an instruction runs; the done half of an
    async pair names the same computation as its start, so it is skipped."""
    if ins.op.endswith(("-done", "-update")):
        return []
    pairs = re.findall(r"\b(body|condition|to_apply|calls|true_computation|false_computation)"
                       r"=%([\w.\-]+)", ins.attrs)
    for group in re.findall(r"\b(branch_computations|called_computations)=\{([^}]*)\}",
                            ins.attrs):
        pairs += [(group[0], c) for c in re.findall(r"%([\w.\-]+)", group[1])]
    return pairs


def _executions(mod: _Module, unknown_trips: int | None = None) -> dict[str, int]:
    """Times each computation runs per step: calls and fusions once per run of
    the caller, a while body known-trip-count times (a loop whose count is decided as it
    runs, e.g. generation's decode loop: ``unknown_trips`` times, or refused), of a
    conditional's branches only the one with the most collective executions (one branch
    runs; the largest is the planner's worst case), the others zero."""
    counts: dict[str, int] = {}
    has_coll = _has_collectives(mod)

    def visit(comp: str, times: int) -> None:
        counts[comp] = counts.get(comp, 0) + times
        for ins in mod.comps.get(comp, []):
            callees = _callees(ins)
            if ins.op == "conditional":
                branches = [c for _, c in callees]
                best = max(branches, key=lambda b: _collective_weight(mod, b))
                for b in branches:
                    visit(b, times if b == best else 0)
                continue
            for attr, callee in callees:
                factor = 1
                if ins.op == "while" and attr in ("body", "condition"):
                    trips = _trip_count(ins)
                    if trips is None and has_coll(callee):
                        if unknown_trips is None:
                            raise ValueError(f"while loop {ins.name} runs collectives but "
                                             "has no known trip count")
                        trips = unknown_trips
                    factor = trips or 1
                visit(callee, times * factor)

    visit(mod.entry, 1)
    return counts


def _has_collectives(mod: _Module):
    memo: dict[str, bool] = {}

    def has(comp: str) -> bool:
        if comp not in memo:
            memo[comp] = False  # breaks (impossible) cycles
            memo[comp] = any(_kind(i.op) or any(has(c) for _, c in _callees(i))
                             for i in mod.comps.get(comp, []))
        return memo[comp]
    return has


def _collective_weight(mod: _Module, comp: str) -> int:
    """Collectives a computation runs per call (loops included): picks the
    heaviest branch of a conditional."""
    sub = _Module(mod.comps, comp, mod.devices)
    try:
        runs = _executions(sub)
    except ValueError:
        return 0
    return sum(runs[c] for c in runs for i in mod.comps.get(c, []) if _kind(i.op))


# ----- one collective ----------------------------------------------------------------------


def _kind(op: str) -> str | None:
    """The collective kind of an opcode; None for the done halves and non-collectives."""
    base = op.removesuffix("-start")
    if base == "ragged-all-to-all":
        base = "all-to-all"
    return base if base in KINDS else None


def _arrays(shape: str) -> list[tuple[str, int]]:
    """(dtype, element count) of each array in a (possibly tuple) shape."""
    out = []
    for dtype, dims in _ARRAY.findall(shape):
        sizes = [int(d.lstrip("<=")) for d in dims.split(",") if d.strip()]
        out.append((dtype, int(np.prod(sizes, dtype=np.int64))))
    return out


def _nbytes(dtype: str, elements: int) -> int:
    return -(-elements * _BITS.get(dtype, 32) // 8)


def _iota(dims: list[int], reshape: list[int], perm: list[int] | None) -> np.ndarray:
    """XLA's iota tile assignment: iota(prod) reshaped, transposed, reshaped to dims."""
    a = np.arange(int(np.prod(reshape))).reshape(reshape)
    if perm is not None:
        a = a.transpose(perm)
    return a.reshape(dims)


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", text)]


def _mesh_groups(text: str) -> np.ndarray:
    """``mesh['a'=4,'b'=2](, device_ids=(...))? {'a',...}``: the mesh's device ids,
    grouped over the listed axes (sub-axes ``'a':(pre)size`` included)."""
    m = re.match(r"mesh\[([^\]]*)\](?:, device_ids=\((.*?)\))? \{([^}]*)\}", text)
    if m is None:
        raise ValueError(f"unknown replica_groups form: {text[:120]}")
    names, sizes = zip(*[(n, int(s)) for n, s in
                         re.findall(r"'?([\w.\-]+)'?=(\d+)", m.group(1))])
    ids = np.arange(int(np.prod(sizes))).reshape(sizes)
    if m.group(2):
        ids = _device_ids(m.group(2), list(sizes))
    # Split each mesh axis into the sub-axes the groups use (pre_size, size), in
    # order of pre_size, with padding dims between; then group over those dims.
    refs = [(names.index(n), int(p) if p else None, int(s) if s else None) for n, p, s in
            re.findall(r"'?([\w.\-]+?)'?(?::\((\d+)\)(\d+))?(?:,|$)", m.group(3).strip())]
    dims, grouped = [], []
    for axis, size in enumerate(sizes):
        subs = sorted((p, s) for a, p, s in refs if a == axis and p is not None)
        whole = any(a == axis and p is None for a, p, _ in refs)
        start = len(dims)
        if whole or not subs:
            dims.append(size)
            grouped += [(axis, None, start)] if whole else []
            continue
        prefix = 1
        for p, s in subs:
            if p != prefix:
                dims.append(p // prefix)
                prefix = p
            grouped.append((axis, p, len(dims)))
            dims.append(s)
            prefix *= s
        if prefix != size:
            dims.append(size // prefix)
    order = [next(d for a, p, d in grouped if a == axis and p == pre) for axis, pre, _ in refs]
    ids = ids.reshape(dims).transpose([d for d in range(len(dims)) if d not in order] + order)
    group = int(np.prod([dims[d] for d in order]))
    return ids.reshape(-1, group)


def _device_ids(text: str, dims: list[int]) -> np.ndarray:
    """A mesh's device_ids: an iota ``[reshape]T(perm)`` or an explicit list."""
    m = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", text.strip())
    if m:
        perm = _ints(m.group(2)) if m.group(2) else None
        return _iota(dims, _ints(m.group(1)), perm)
    return np.array(_ints(text)).reshape(dims)


def _replica_groups(attrs: str, devices: int) -> np.ndarray:
    """Groups as a [groups, size] array, from any of XLA's three printed forms."""
    m = re.search(r"replica_groups=(mesh\[[^\]]*\](?:, device_ids=\(.*?\))? \{[^}]*\}|\S+)",
                  attrs)
    if m is None:
        return np.arange(devices).reshape(1, -1)
    text = m.group(1).rstrip(",")
    if text.startswith("mesh"):
        return _mesh_groups(text)
    if text.startswith("["):  # [groups,size]<=[reshape]T(perm)
        it = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
        perm = _ints(it.group(3)) if it.group(3) else None
        return _iota(_ints(it.group(1)), _ints(it.group(2)), perm)
    groups = [_ints(g) for g in re.findall(r"\{([\d,]*)\}", text)]
    groups = [g for g in groups if g] or [list(range(devices))]
    return np.array(groups)


def _permute_groups(attrs: str) -> np.ndarray | list[list[int]]:
    """Connected components of a collective-permute's source-target pairs."""
    pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    if pairs is None:
        return [[0]]
    parent: dict[int, int] = {}

    def root(x: int) -> int:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(0)):
        parent[root(int(a))] = root(int(b))
    comps: dict[int, list[int]] = {}
    for x in sorted(parent):
        comps.setdefault(root(x), []).append(x)
    return sorted(comps.values())


# ----- the CPU-lowered reduce-scatter ------------------------------------------------------


def _users(comp: list[_Instr], name: str) -> list[_Instr]:
    return [i for i in comp if name in i.operands]


def _slice_elements(mod: _Module, comp: str, name: str) -> set[int] | None:
    """Element counts of the dynamic-slices that are the only consumers of value
    ``name`` (directly, through bitcasts, or as a fusion parameter whose only
    users in the fused computation are dynamic-slices); None if any consumer
    uses the whole value."""
    users = _users(mod.comps[comp], name)
    if not users:
        return None
    found: set[int] = set()
    for u in users:
        if u.op == "dynamic-slice" and u.operands[0] == name:
            found.add(_arrays(u.shape)[0][1])
        elif u.op == "bitcast":
            sub = _slice_elements(mod, comp, u.name)
            if sub is None:
                return None
            found |= sub
        elif u.op == "fusion" and (fused := re.search(r"calls=%([\w.\-]+)", u.attrs)):
            body = mod.comps.get(fused.group(1), [])
            for k, operand in enumerate(u.operands):
                if operand != name:
                    continue
                param = next((i for i in body if i.op == "parameter" and i.args == str(k)), None)
                sub = _slice_elements(mod, fused.group(1), param.name) if param else None
                if sub is None:
                    return None
                found |= sub
        else:
            return None
    return found


def _scattered(mod: _Module, comp: str, value: str, shape: str, group: int) -> list[int | None]:
    """Per element of an all-reduce's result: the shard's element count if that
    element is the CPU lowering of a reduce-scatter, else None.

    Rule: every consumer of the element (through get-tuple-element for a tuple
    result) is a dynamic-slice of it (possibly inside a fusion, possibly after a
    bitcast), all of one size, and that size divides 1/group of the element. The
    shard is 1/group of the element: a slice finer than that (fsdp x context
    gradients are all-reduced over context, then over fsdp, then cut to 1/8) is
    a reduce-scatter over this group plus a local slice; the chain of
    all-reduces is not merged into one reduce-scatter over the product group.
    Limits: the slice offsets are not checked to come from the device's index
    in the group (a planner-scale HLO has no other reason to slice a freshly
    all-reduced gradient to 1/group on every device); an all-reduce of which
    any consumer reads the whole array stays an all-reduce.
    """
    arrays = _arrays(shape)
    if not shape.startswith("("):
        names = {0: value}
    else:
        names = {}
        for u in _users(mod.comps[comp], value):
            if u.op != "get-tuple-element":
                return [None] * len(arrays)
            names[int(re.search(r"index=(\d+)", u.attrs).group(1))] = u.name
    out: list[int | None] = []
    for k, (_, elements) in enumerate(arrays):
        sizes = _slice_elements(mod, comp, names[k]) if k in names else None
        ok = sizes is not None and len(sizes) == 1 and elements % (next(iter(sizes)) * group) == 0
        out.append(elements // group if ok and group > 1 else None)
    return out


def _widened_bits(mod: _Module, comp: str, name: str, depth: int = 0) -> int | None:
    """16 when value ``name`` of ``comp`` is a float32 widened from a 16-bit float (a
    convert, possibly behind bitcasts/copies, inside a fusion, or both sides of a
    select whose other side is a constant), else None."""
    by_name = {i.name: i for i in mod.comps.get(comp, [])}
    ins = by_name.get(name)
    while ins is not None and depth < 40:
        depth += 1
        if ins.op in ("bitcast", "copy", "reshape", "transpose") and ins.operands:
            ins = by_name.get(ins.operands[0])
        elif ins.op == "convert" and ins.operands:
            src = by_name.get(ins.operands[0])
            return 16 if src is not None and _arrays(src.shape)[0][0] in ("bf16", "f16") else None
        elif ins.op == "select" and len(ins.operands) == 3:
            sides = [0 if _constant(by_name.get(o), by_name)
                     else _widened_bits(mod, comp, o, depth) for o in ins.operands[1:]]
            return 16 if all(b in (0, 16) for b in sides) and 16 in sides else None
        elif ins.op == "fusion":
            called = next((c for a, c in _callees(ins) if a == "calls"), None)
            body = mod.comps.get(called or "", [])
            root = body[-1] if body else None  # XLA prints the ROOT last
            return _widened_bits(mod, called, root.name, depth) if root else None
        else:
            return None
    return None


def _constant(ins: _Instr | None, by_name: dict[str, _Instr]) -> bool:
    """A constant, or a broadcast of one (a masked-out side of a select)."""
    if ins is not None and ins.op == "broadcast" and ins.operands:
        ins = by_name.get(ins.operands[0])
    return ins is not None and ins.op == "constant"


def _operand_bits(mod: _Module, comp: str, ins: _Instr, arrays: list,
                  cpu_compiled: bool = True) -> list[int]:
    """Per result array, the bits per element a GPU would move: 16 where the CPU
    widened a 16-bit float operand to f32 (``cpu_compiled``), else the array's own."""
    bits = [_BITS.get(d, 32) for d, _ in arrays]
    if not cpu_compiled or len(ins.operands) != len(arrays):  # (not one operand per array)
        return bits
    return [16 if d == "f32" and _widened_bits(mod, comp, op) == 16 else b
            for (d, _), op, b in zip(arrays, ins.operands, bits)]


# ----- public API --------------------------------------------------------------------------


def _dtype(arrays: Iterable[tuple[str, int]]) -> str:
    return "+".join(dict.fromkeys(d for d, _ in arrays)) or "-"


def _of(mod: _Module, comp: str, ins: _Instr, executed: int,
        cpu_compiled: bool = True) -> list[Collective]:
    kind = _kind(ins.op)
    # An async start's own shape also holds its operands and contexts; its done
    # has the result.
    done = next((u for u in _users(mod.comps[comp], ins.name) if u.op.endswith("-done")), None)
    value = done or ins
    arrays = _arrays(value.shape)
    if kind == "collective-permute":
        groups = [tuple(g) for g in _permute_groups(ins.attrs)]
    else:
        groups = [tuple(int(x) for x in g) for g in _replica_groups(ins.attrs, mod.devices)]
    size = max(len(g) for g in groups)
    bits = dict(zip(range(len(arrays)), _operand_bits(mod, comp, ins, arrays, cpu_compiled)))

    def make(kind: str, picked: list[int], lowered: str | None) -> Collective:
        chosen = [arrays[i] for i in picked]
        total = sum(_nbytes(d, n) for d, n in chosen)
        wire = sum(_nbytes(d, n) * bits[i] // _BITS.get(d, 32) for i, (d, n) in zip(picked, chosen))
        return Collective(kind, _dtype(chosen), total, size, tuple(groups), executed, lowered,
                          ins.name, None if wire == total else wire)

    everything = list(range(len(arrays)))
    if ins.op.startswith("ragged-all-to-all"):
        send = _ragged_send(mod, comp, ins)
        if send is not None and _nbytes(*send) < _nbytes(*arrays[0]):
            arrays[0] = send
        return [make(kind, everything, "ragged-all-to-all")]
    if kind != "all-reduce":
        return [make(kind, everything, None)]
    shards = _scattered(mod, comp, value.name, value.shape, size)
    # A combined all-reduce can hold both kinds: a GPU compile would issue them
    # as separate collectives, so they are listed separately. A scattered part's
    # result is its shard.
    scattered = [i for i in everything if shards[i] is not None]
    whole = [i for i in everything if shards[i] is None]
    for i in scattered:
        arrays[i] = (arrays[i][0], shards[i])
    out = [make("reduce-scatter", scattered, LOWERED_RS)] if scattered else []
    return out + ([make("all-reduce", whole, None)] if whole else [])


def _ragged_send(mod: _Module, comp: str, ins: _Instr) -> tuple[str, int] | None:
    """(dtype, elements) of a ragged all-to-all's send buffer, its first operand: the
    start of an async pair lists its operands' shapes first in its own tuple shape."""
    if ins.op.endswith("-start"):
        arrays = _arrays(ins.shape)
        return arrays[0] if arrays else None
    by_name = {i.name: i for i in mod.comps.get(comp, [])}
    operand = by_name.get(ins.operands[0]) if ins.operands else None
    arrays = _arrays(operand.shape) if operand is not None else []
    return arrays[0] if arrays else None


def collectives(hlo_text: str, cpu_compiled: bool = True,
                unknown_trips: int | None = None) -> list[Collective]:
    """Every collective in an optimized HLO module's text, in text order.
    ``cpu_compiled``: the text is XLA:CPU's, whose float32 collectives of converted
    16-bit floats are read as the 16-bit ones a GPU would move (``wire_bytes``). False
    for XLA:GPU's text, which moves what it says: there such a convert is the
    program's own (a float32 sum of bfloat16 partial gradients). ``unknown_trips``: how
    many times a while loop whose trip count the text does not say runs (1: per trip,
    e.g. per generated token); None refuses such a loop that runs collectives."""
    mod = _parse(hlo_text)
    runs = _executions(mod, unknown_trips)
    out: list[Collective] = []
    for comp, instrs in mod.comps.items():
        for ins in instrs:
            if _kind(ins.op):
                out += _of(mod, comp, ins, runs.get(comp, 0), cpu_compiled)
    return out


def in_conditionals(hlo_text: str) -> set[str]:
    """Names of the collectives that run inside a conditional's branches (in them, or
    in what they call). Where XLA's partitioner must split a conditional's operands
    itself it may gather them there, on every step the branch runs: ring and tiled
    attention's skipping conditionals did, compiled for GPUs, until they ran in a
    shard_map manual over every mesh axis (``ndjax.ops.attention._per_shard``)."""
    mod = _parse(hlo_text)
    todo = [c for instrs in mod.comps.values() for i in instrs if i.op == "conditional"
            for _, c in _callees(i)]
    seen: set[str] = set()
    while todo:
        comp = todo.pop()
        if comp not in seen:
            seen.add(comp)
            todo += [c for i in mod.comps.get(comp, []) for _, c in _callees(i)]
    return {i.name for comp in seen for i in mod.comps.get(comp, []) if _kind(i.op)}


def summarize(cs: Iterable[Collective]) -> dict[str, dict[str, int]]:
    """Per kind: instructions in the text, executions per step, result bytes moved
    per step (``bytes x executed``), and ring bytes sent per device per step."""
    out: dict[str, dict[str, int]] = {}
    for c in cs:
        s = out.setdefault(c.kind, dict(static=0, executed=0, bytes=0, ring_bytes=0))
        s["static"] += 1
        s["executed"] += c.executed
        s["bytes"] += c.bytes * c.executed
        s["ring_bytes"] += round(c.ring_bytes * c.executed)
    return out
