"""Plot runs side by side: loss (train, eval), tokens/s and MFU against step.

    python -m ndjax.plot --workdir=runs/fsdp_tp --workdir=runs/dp [--out=compare.png]
"""

# The program (and its argparse --help) is ndjax/verbs/plot.py; why verbs live in
# ndjax/verbs/: ndjax/verbs/__init__.py.
from ndjax.verbs.plot import *  # noqa: F403 -- the old import path keeps working
from ndjax.verbs.plot import main

if __name__ == "__main__":
    main()
