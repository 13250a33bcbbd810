"""The command-line verbs, one module each. ``ndjax <verb>`` (``python -m ndjax <verb>``,
ndjax/__main__.py) calls its module's ``main()``, as ``python -m ndjax.verbs.<verb>``
does; train.py (the repository root) trains, and ``ndjax prepare`` is
ndjax/data/prepare.py, with the data pipeline it belongs to.

- ``plan``: rank every mesh for N GPUs by compiled memory and communication
- ``compile``: compile one step for N GPUs of a kind this machine lacks; what it needs
- ``generate``: completions from a run's checkpoint or a Hugging Face directory
- ``export``: a run's checkpoint as a Hugging Face directory
- ``plot``: runs' loss, throughput and MFU side by side
- ``from_axolotl``: an Axolotl YAML config as an ndjax config file

A verb defines its absl flags in ``define_flags()``, called by ``main()``, never on
import: verbs share flag names (``--step``, ``--devices``, ``--config``) and absl
refuses a flag defined twice in one process, so a test or a script that imports two
verbs would fail. ``--help`` prints the verb module's docstring (ndjax/__main__.py hands
it to absl, which reads ``__main__``'s) and the flags ``ndjax.runtime.cli.show_in_help``
lists for it.
"""
