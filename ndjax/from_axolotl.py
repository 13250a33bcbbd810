"""Convert an Axolotl YAML config into an ndjax config file.

    python -m ndjax.from_axolotl config.yml [--out=configs/mine.py] [--force] [--devices=N]

The mapping, field by field: docs/from-axolotl.md.
"""

# The program (and its argparse --help) is ndjax/verbs/from_axolotl.py; why verbs live in
# ndjax/verbs/: ndjax/verbs/__init__.py.
from ndjax.verbs.from_axolotl import *  # noqa: F403 -- the old import path keeps working
from ndjax.verbs.from_axolotl import main

if __name__ == "__main__":
    main()
