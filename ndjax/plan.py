r"""Rank every mesh for N GPUs by compiled memory and communication, before renting them.

    python -m ndjax.plan --config=configs/llama_fsdp.py --devices=64 \
        [--config.model.preset=llama3_8b ...] [--hardware=h100] [--top=5] [--json]

Reading the table: docs/compile-and-plan.md ("Choosing a layout").
"""

# The program is ndjax/verbs/plan.py; --help prints the docstring above (absl reads
# __main__'s). Why verbs live in ndjax/verbs/: ndjax/verbs/__init__.py.
from ndjax.verbs.plan import *  # noqa: F403 -- the old import path keeps working
from ndjax.verbs.plan import main

if __name__ == "__main__":
    main()
