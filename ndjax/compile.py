r"""Compile a step for N NVIDIA GPUs on a machine without them, and say what it needs.

    python -m ndjax.compile --config=configs/llama_fsdp_tp.py --hardware=h100 --devices=8 \
        [--config.train.seq_len=16384 ...] [--step=train|eval|decode] [--json]

Needs the gpu-compile extra; what it cannot see: docs/compile-and-plan.md.
"""

# The program is ndjax/verbs/compile.py; --help prints the docstring above (absl reads
# __main__'s). Why verbs live in ndjax/verbs/: ndjax/verbs/__init__.py.
from ndjax.verbs.compile import *  # noqa: F403 -- the old import path keeps working
from ndjax.verbs.compile import main

if __name__ == "__main__":
    main()
