"""The command-line verbs: each lives in ndjax/verbs/, runs as ``python -m ndjax.<verb>``
through a shim at the old path, and its --help fits on a screen."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VERBS = ("plan", "compile", "generate", "export", "plot", "from_axolotl")
HELP_LINES = 40  # a terminal's screenful, with the prompt


def _runs_as_main(path: Path) -> bool:
    """Whether the module has an ``if __name__ == "__main__":`` block."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and \
                isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__":
            return True
    return False


def test_every_program_in_the_package_root_is_a_verbs_shim():
    # A new verb goes into ndjax/verbs/ (see its __init__), not beside the library.
    programs = {p.stem for p in (ROOT / "ndjax").glob("*.py") if _runs_as_main(p)}
    assert programs == set(VERBS)
    assert {p.stem for p in (ROOT / "ndjax" / "verbs").glob("*.py")} - {"__init__"} == set(VERBS)
    for verb in VERBS:
        shim = (ROOT / "ndjax" / f"{verb}.py").read_text()
        assert f"from ndjax.verbs.{verb} import main" in shim, verb


def test_the_shims_keep_the_old_import_paths():
    from ndjax import compile, export, generate, plan, plot  # noqa: A004
    from ndjax.verbs import compile as compile_verb
    from ndjax.verbs import export as export_verb
    from ndjax.verbs import generate as generate_verb

    assert compile.compile_for is compile_verb.compile_for
    assert export.export_checkpoint is export_verb.export_checkpoint
    assert generate.load is generate_verb.load
    assert callable(plan.report) and callable(plot.plot)


@pytest.mark.parametrize("command", [*(("-m", f"ndjax.{verb}") for verb in VERBS),
                                     ("train.py",)], ids=[*VERBS, "train.py"])
def test_help_fits_a_screen_and_lists_the_flags(command):
    result = subprocess.run([sys.executable, *command, "--help"], cwd=ROOT, capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    # absl's --help exits 1, argparse's 0.
    assert result.returncode in (0, 1) and "Traceback" not in result.stderr, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert len(lines) < HELP_LINES, result.stdout
    assert sum(line.lstrip().startswith("--") for line in lines) >= 2, result.stdout
