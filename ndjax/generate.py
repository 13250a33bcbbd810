r"""Sample completions from a training run or a Hugging Face model directory.

    python -m ndjax.generate --workdir=runs/llama_fsdp_tp --prompt='import os' [--json]
    python -m ndjax.generate --hf_dir=DIR --chat --prompts_file=prompts.jsonl

How prompts are tokenized and where generation stops: docs/sampling.md.
"""

# The program is ndjax/verbs/generate.py; --help prints the docstring above (absl reads
# __main__'s). Why verbs live in ndjax/verbs/: ndjax/verbs/__init__.py.
from ndjax.verbs.generate import *  # noqa: F403 -- the old import path keeps working
from ndjax.verbs.generate import main

if __name__ == "__main__":
    main()
