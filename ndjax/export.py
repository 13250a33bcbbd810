r"""Export a training checkpoint as a Hugging Face directory.

    python -m ndjax.export --workdir=runs/llama_fsdp_tp --out=hf/llama [--step=N] \
        [--dtype=bfloat16]

The run's experiment is rebuilt from <workdir>/config.json, so run this where the
run's devices are. Bad input is one line on stderr, exit code 2.
"""

# The program is ndjax/verbs/export.py; --help prints the docstring above (absl reads
# __main__'s). Why verbs live in ndjax/verbs/: ndjax/verbs/__init__.py.
from ndjax.verbs.export import *  # noqa: F403 -- the old import path keeps working
from ndjax.verbs.export import main

if __name__ == "__main__":
    main()
