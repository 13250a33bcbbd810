"""ndjax's commands: ``ndjax <verb> [flags]``, or ``python -m ndjax <verb> [flags]``.

    plan          rank every mesh for N GPUs by compiled memory and communication
    compile       compile one step for N GPUs this machine lacks, and say what it needs
    generate      completions from a run's checkpoint or a Hugging Face directory
    export        a run's checkpoint as a Hugging Face directory
    plot          runs' loss, throughput and MFU side by side
    from_axolotl  an Axolotl YAML config as an ndjax config file
    prepare       a corpus pre-tokenized into a token file

``ndjax <verb> --help`` for a verb's flags. Training is ``python train.py --config=...``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# verb -> the module whose main() runs it. The verbs of ndjax/verbs/ and the data
# pipeline's prepare, which stays with the pipeline it belongs to.
VERBS = {
    "plan": "ndjax.verbs.plan",
    "compile": "ndjax.verbs.compile",
    "generate": "ndjax.verbs.generate",
    "export": "ndjax.verbs.export",
    "plot": "ndjax.verbs.plot",
    "from_axolotl": "ndjax.verbs.from_axolotl",
    "prepare": "ndjax.data.prepare",
}


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
        print(__doc__.strip())
        sys.exit(0 if len(argv) >= 2 else 2)
    verb = argv[1]
    if verb not in VERBS:
        print(f"ndjax: error: no verb {verb!r}; one of {', '.join(VERBS)} "
              "(ndjax --help says what each does).", file=sys.stderr)
        sys.exit(2)
    module = importlib.import_module(VERBS[verb])
    # The verb sees itself as the program: absl's --help prints __main__'s docstring and
    # the flags registered for sys.argv[0]; argparse reads sys.argv[1:].
    sys.modules["__main__"].__doc__ = module.__doc__
    sys.argv = [f"ndjax {verb}", *argv[2:]]
    sys.exit(module.main())


if __name__ == "__main__":
    main()
