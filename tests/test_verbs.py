"""The command-line verbs: each lives in ndjax/verbs/, runs as ``ndjax <verb>`` (or
``python -m ndjax <verb>``), and its --help fits on a screen."""

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


def test_the_one_program_in_the_package_root_is_ndjax_and_it_runs_every_verb():
    # A new verb goes into ndjax/verbs/ (see its __init__) and __main__.VERBS, not beside
    # the library.
    from ndjax.__main__ import VERBS as COMMANDS
    programs = {p.stem for p in (ROOT / "ndjax").glob("*.py") if _runs_as_main(p)}
    assert programs == {"__main__"}
    assert {p.stem for p in (ROOT / "ndjax" / "verbs").glob("*.py")} - {"__init__"} == set(VERBS)
    assert set(COMMANDS) == {*VERBS, "prepare"}
    assert all(COMMANDS[verb] == f"ndjax.verbs.{verb}" for verb in VERBS)


def _ndjax(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ndjax", *args], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)


def test_ndjax_alone_lists_the_verbs_and_an_unknown_one_is_one_line():
    alone = _ndjax()
    assert alone.returncode == 2 and all(verb in alone.stdout for verb in (*VERBS, "prepare"))
    unknown = _ndjax("trian", "--config=configs/llama_fsdp.py")
    assert unknown.returncode == 2 and not unknown.stdout
    assert unknown.stderr.strip().splitlines() == [
        "ndjax: error: no verb 'trian'; one of plan, compile, generate, export, plot, "
        "from_axolotl, prepare (ndjax --help says what each does)."]


def test_the_installed_command_is_ndjax():
    # pip install puts it beside the interpreter (pyproject's [project.scripts]).
    command = Path(sys.executable).parent / "ndjax"
    if not command.exists():
        pytest.skip(f"ndjax is not installed beside {sys.executable} (not a pip install)")
    result = subprocess.run([str(command), "plot", "--help"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.startswith("usage: ndjax plot"), result


@pytest.mark.parametrize("command", [*(("-m", "ndjax", verb) for verb in (*VERBS, "prepare")),
                                     ("train.py",)], ids=[*VERBS, "prepare", "train.py"])
def test_help_fits_a_screen_and_lists_the_flags(command):
    result = subprocess.run([sys.executable, *command, "--help"], cwd=ROOT, capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    # absl's --help exits 1, argparse's 0.
    assert result.returncode in (0, 1) and "Traceback" not in result.stderr, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert len(lines) < HELP_LINES, result.stdout
    assert sum(line.lstrip().startswith("--") for line in lines) >= 2, result.stdout
    if command[0] == "-m":  # the verb's own usage, not ndjax's list of verbs
        assert f"ndjax {command[2]} " in result.stdout, result.stdout
