"""Convert an Axolotl YAML config into an ndjax config file.

    ndjax from_axolotl config.yml [--out=configs/mine.py] [--force] [--devices=N]

``convert`` maps the fields ndjax has (mesh, model, data, optimiser, schedule,
checkpoints), lists every other one with the reason, and collects every problem (a
value it cannot take, a check that fails) rather than stopping at the first; ``render``
writes the result as a ``configs/*.py``-style file, which ``main`` loads and checks as
train.py would (every field's type and range, the checkpoint, tokenizer, chat template
and data files) before it writes anything. A failure is one report on stderr: the
fields not mapped, then each problem on a line of its own, exit 2, nothing written.
docs/from-axolotl.md has the whole mapping.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import re
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from ndjax.axolotl import adapter, datasets, run, trackers
from ndjax.axolotl.fields import Fields, Out, Unmapped, reason
from ndjax.runtime.cli import fail
from ndjax.runtime.errors import ConfigError

PROGRAM = "ndjax from_axolotl"


@dataclasses.dataclass
class Conversion:
    overrides: dict[str, Any]   # "section.field" -> value, in the order they were mapped
    notes: dict[str, str]       # "section.field" -> the Axolotl fields it comes from
    unmapped: list[Unmapped]
    workdir: str                # train.py's --workdir (output_dir)
    problems: list[str] = dataclasses.field(default_factory=list)  # one line each


class ConversionError(ConfigError):
    """Every problem of a conversion, one a line; ``conversion`` holds the rest of what
    it found (the fields not mapped), for the report."""

    def __init__(self, conversion: Conversion):
        super().__init__("\n".join(conversion.problems))
        self.conversion = conversion


def convert(raw: Mapping[str, Any], devices: int | None = None) -> Conversion:
    """An Axolotl config (the YAML's top-level mapping) as ndjax config overrides and
    the fields left unmapped. Reads base_model's config.json and lists the data files'
    directories; writes nothing. ``devices``: the GPUs the run will use (Axolotl's world
    size), needed where Axolotl would infer dp_shard_size or dp_replicate_size from it.

    Raises ``ConversionError`` with every problem found: each part of the conversion
    goes on past a refused value (with a stand-in, never written), and the parts that
    need a refused one (the family and tokenizer of a refused base_model, say) are left
    out, so that each problem is reported once, under its own field."""
    out = Out()
    f = Fields(raw, problems=out.problems)
    layout = run.mesh(f, out, devices)
    steps = run.schedule(f, out, layout.data)
    run.precision(f, out)
    run.outputs(f, out, steps)
    trackers.trackers(f, out)
    base = out.attempt(run.base_model, f)
    run.tokens(f, out)
    datasets.data(f, out, steps, out.attempt(run.tokenizer, f, base), layout.context)
    # Last: the family's look-up imports the model registry (jax), so bad input above is
    # reported without that wait.
    family = out.attempt(run.family, base) if base is not None else None
    if family is not None:
        out.set("model.family", family, "from base_model's config.json (model_type)")
        out.set("model.init_from", base, "base_model: its config.json and safetensors")
        out.attempt(run.experts, base, layout.expert)
    out.attempt(run.router, f, out, base if family is not None else None)
    workdir = run.workdir(f, out, out.attempt(adapter.lora, f, out, fallback=True))
    for key in f.rest():
        out.skip(str(key), f.raw[key], reason(str(key), f.raw[key]))
    # A field read and found off (lora_model_dir:, load_in_8bit: false, val_set_size: 0)
    # that no setting names is listed too: nothing a user wrote goes unmentioned.
    named = " ".join(out.notes.values())
    for key in f.read:
        if key in f.raw and key not in out.unmapped and key not in named and \
                reason(str(key), f.raw[key]) == "off, nothing to map":
            out.skip(str(key), f.raw[key], "off, nothing to map")
    order = {str(key): i for i, key in enumerate(raw)}  # as the YAML lists them
    unmapped = sorted(out.unmapped.values(),
                      key=lambda u: order.get(re.split(r"[.\[]", u.field)[0], len(order)))
    problems = list(dict.fromkeys(out.problems))  # a value read twice is reported once
    conv = Conversion(out.overrides, out.notes, unmapped, workdir, problems)
    if problems:
        raise ConversionError(conv)
    return conv


# ----- the config file ----------------------------------------------------------

def render(conv: Conversion, source: str) -> str:
    """The ndjax config file: ``get_config()`` over ``default_config()``, each line
    commented with the Axolotl fields it comes from, the unmapped ones listed on top."""
    sections = ("mesh", "runtime", "model", "data", "train", "preference", "grpo", "checkpoint",
                "log", "export")
    lines = [
        '"""ndjax config converted from an Axolotl config by ndjax from_axolotl."""',
        "",
        f"# Converted from: {_one_line(source)}",
        f"# Train: python train.py --config=THIS_FILE --workdir={_one_line(conv.workdir)}",
        f"# Axolotl fields not mapped ({len(conv.unmapped)}; docs/from-axolotl.md says why):",
        *(f"#   {_one_line(u.line())}" for u in conv.unmapped),
        "",
        "from ndjax.config import default_config",
        "",
        "",
        "def get_config():",
        "    c = default_config()",
    ]
    for section in sections:
        for path in (p for p in conv.overrides if p.split(".")[0] == section):
            note = _one_line(conv.notes[path])
            lines.append(f"    c.{path} = {conv.overrides[path]!r}  # {note}")
    lines += ["    return c", ""]
    return "\n".join(lines)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def load(text: str) -> Any:
    """The ConfigDict of a rendered config file, imported as train.py imports one."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "converted.py")
        with open(path, "w") as fh:
            fh.write(text)
        spec = importlib.util.spec_from_file_location("ndjax_converted_config", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.get_config()


def world_size(conv: Conversion) -> int | None:
    """The GPUs the converted mesh lays out: its runtime.cpu_devices, the same mesh
    simulated on a CPU-only host (None where the mesh was refused)."""
    return conv.overrides.get("runtime.cpu_devices")


def check(text: str, conv: Conversion) -> None:
    """Loads the rendered file and runs ndjax's checks: those that need no devices
    (``Settings.parse`` and ``check_inputs``: the checkpoint, tokenizer, chat template,
    data files and export directories, every one that fails reported), then, where this
    process has the converted mesh's device count as CPU devices (the CLI makes them),
    the layout's own that hold on any platform (``check_layout``: shapes the axes must
    divide, the batch, the experts), as train.py would on the GPUs; the kernels' own
    are left to train.py on the GPUs. Nothing compiles.
    Each failure names the Axolotl fields its values came from; a ConfigError holds them
    one a line."""
    from ndjax.runtime.console import import_jax_quietly

    import_jax_quietly()
    import jax

    from ndjax.config import Settings
    from ndjax.experiment import check_inputs, check_layout
    problems: list[str] = []
    try:
        settings = Settings.parse(load(text))
        model_cfg, _ = check_inputs(settings, platform="gpu", problems=problems)
        n, devices = world_size(conv), jax.devices("cpu")
        if not problems and n is not None and len(devices) >= n:
            check_layout(settings, model_cfg, devices[:n])
    except ConfigError as e:
        problems.append(str(e))
    if problems:
        raise ConfigError("\n".join(_from_axolotl_fields(p, conv) for p in problems))


def _from_axolotl_fields(problem: str, conv: Conversion) -> str:
    sources = [f"{p} from {conv.notes[p]}" for p in conv.overrides
               if re.search(rf"\b{re.escape(p)}\b", problem)]
    where = f" ({'; '.join(sources)})" if sources else ""
    return f"the converted config fails ndjax's checks: {problem}{where}"


def simulate_devices(n: int | None) -> None:
    """Before jax's backends start: ``n`` CPU devices, so that ``check`` can lay the mesh
    out (the conversion imports jax, but starts no backend)."""
    import jax
    from jax._src import xla_bridge

    if n and n > 1 and not xla_bridge.backends_are_initialized():
        jax.config.update("jax_num_cpu_devices", n)


# ----- command line -------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, as every ndjax tool
        fail(PROGRAM, f"{message} (see --help)")
        raise AssertionError  # fail exits


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROGRAM, description="Write an ndjax config file (for "
                "train.py --config) from an Axolotl YAML config. Every Axolotl field it does "
                "not map is listed on stderr with the reason; docs/from-axolotl.md has the "
                "mapping.")
    p.add_argument("config", help="the Axolotl YAML file")
    p.add_argument("--out", help="the ndjax config file to write (default: print it)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--devices", type=int, help="GPUs the run will use (Axolotl's world size); "
                   "needed when dp_shard_size is not set")
    return p


def read_yaml(path: str) -> Mapping[str, Any]:
    import yaml

    try:
        with open(path) as fh:
            raw = yaml.safe_load(fh)
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}.") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); is it "
                          "the Axolotl YAML file?") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or e
        raise ConfigError(f"{path} is not valid YAML{at}: {problem}; fix the file.") from None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path} holds a {type(raw).__name__}, not a mapping of Axolotl "
                          "fields (base_model: ..., datasets: ...).")
    return raw


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    from ndjax.runtime.console import one_line_warnings

    one_line_warnings(PROGRAM)
    try:
        if args.out and os.path.exists(args.out) and not args.force:
            raise ConfigError(f"--out={args.out} exists; pass --force to overwrite it.")
        if args.devices is not None and args.devices < 1:
            raise ConfigError(f"--devices={args.devices} must be >= 1.")
        raw = read_yaml(args.config)
    except ConfigError as e:  # no fields to report: one line
        fail(PROGRAM, e)
    try:
        conv = convert(raw, args.devices)
    except ConversionError as e:
        conv = e.conversion
    text = render(conv, args.config)
    if not conv.problems:
        # Only a whole conversion is checked: one with stand-ins for refused values
        # would fail again for them, under other names.
        try:
            simulate_devices(world_size(conv))
            check(text, conv)
        except ConfigError as e:
            conv.problems.extend(str(e).splitlines())
    for u in conv.unmapped:
        print(f"{PROGRAM}: not mapped: {_one_line(u.line())}", file=sys.stderr)
    if conv.problems:
        for problem in conv.problems:
            print(f"{PROGRAM}: error: {_one_line(problem)}", file=sys.stderr)
        n, m = len(conv.problems), len(conv.unmapped)
        print(f"{PROGRAM}: {n} problem{'s' * (n != 1)} (the error lines), {m} field"
              f"{'s' * (m != 1)} not mapped; nothing written.", file=sys.stderr, flush=True)
        sys.exit(2)
    target = args.out or "<the file you save it as>"
    if args.out:
        tmp = f"{args.out}.tmp"
        try:
            with open(tmp, "w") as fh:
                fh.write(text)
            os.replace(tmp, args.out)  # whole or absent
        except OSError as e:
            fail(PROGRAM, f"cannot write --out={args.out}: {e.strerror}.")
    else:
        sys.stdout.write(text)
    print(f"{PROGRAM}: {len(conv.overrides)} settings mapped, {len(conv.unmapped)} fields not "
          f"mapped; train with: python train.py --config={target} --workdir={conv.workdir}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
