"""What the command-line tools that take ``--config=configs/NAME.py`` share: bad input
(a config file that does not load, a bad ``--config.x=y`` override, an unknown
flag) is one line on stderr naming the program, exit code 2."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

from absl import flags

BAD_OVERRIDE = (AttributeError, KeyError, TypeError, ValueError)


def innermost(e: BaseException) -> str:
    """config_flags wraps the useful message in layers of exceptions."""
    while isinstance(e, BaseException) and e.args:
        e = e.args[0]
    return str(e)


def fail(program: str, message: object, exit: Callable[[int], object] = sys.exit) -> None:
    """One line, exit 2. From another thread pass exit=os._exit (sys.exit there
    would only end the thread)."""
    print(f"{program}: error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    exit(2)


def loaded_config(program: str, flag: flags.FlagHolder | flags.Flag) -> Any:
    """The ``--config`` ConfigDict; a config file that failed to load or a bad
    override (both surface on first access) is one line, exit 2."""
    try:
        config = flag.value
        config.runtime  # noqa: B018 -- a config file that failed to load raises on access
    except OSError as e:
        fail(program, f"cannot load --config: {innermost(e)}")
    except BAD_OVERRIDE as e:
        fail(program, f"bad --config override: {innermost(e)}")
    return config


def show_in_help(holders: Iterable[flags.FlagHolder]) -> None:
    """Lists a verb's flags under ``--help``, which shows only the flags of the program's
    own file (``sys.argv[0]``): ``ndjax plan`` runs ndjax/__main__.py, while
    ndjax/verbs/plan.py defines the flags. Each default joins its flag's text
    (absl gives it a line of its own), and "None" is left out, so that a verb's help
    fits on a screen."""
    for holder in holders:
        flag = flags.FLAGS[holder.name]
        if flag.default is not None and flag.default_as_str is not None:
            flag.help = f"{flag.help} (default: {flag.default_as_str})"
        flag.default_as_str = None
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)


def config_path(argv: list[str]) -> str | None:
    """The --config file named on the command line (without a ':override' suffix)."""
    for i, arg in enumerate(argv[1:], start=1):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def failure_in_file(e: BaseException, path: str) -> str | None:
    """'line N: Error: message' when ``e`` was raised by the code of ``path`` (a syntax
    error in it, or an exception while importing it or running its get_config)."""
    target = os.path.realpath(path)
    if isinstance(e, SyntaxError) and e.filename and os.path.realpath(e.filename) == target:
        return f"line {e.lineno}: SyntaxError: {e.msg}"
    line = None
    tb = e.__traceback__
    while tb is not None:
        if os.path.realpath(tb.tb_frame.f_code.co_filename) == target:
            line = tb.tb_lineno
        tb = tb.tb_next
    return None if line is None else f"line {line}: {type(e).__name__}: {e}"


def config_flags_parser(program: str) -> Callable[[list[str]], list[str]]:
    """absl's parser for ``app.run(main, flags_parser=...)``, with a config file that
    fails to load or a bad ``--config.x=...`` override as one line, not a traceback."""

    def parse(argv: list[str]) -> list[str]:
        try:
            return flags.FLAGS(argv)
        except flags.Error as e:
            fail(program, e)
        except Exception as e:
            path = config_path(argv)
            where = None if path is None else failure_in_file(e, path)
            if where is not None:
                fail(program, f"cannot load --config={path}: {where}")
            if path is not None and isinstance(e, AttributeError) and "get_config" in str(e):
                fail(program, f"--config={path} has no get_config() function; a config file "
                     "defines get_config() returning the experiment's ConfigDict (see configs/).")
            if isinstance(e, BAD_OVERRIDE):
                fail(program, f"bad --config override: {innermost(e)}")
            raise
        return []

    return parse
