"""The command-line verbs, one module each. ``python -m ndjax.<verb>`` runs
``ndjax/<verb>.py``, a shim that keeps the old import path and calls this package's
module's ``main()``; train.py (the repository root) trains, and
``python -m ndjax.data.prepare`` stays with the data pipeline it belongs to.

- ``plan``: rank every mesh for N GPUs by compiled memory and communication
- ``compile``: compile one step for N GPUs of a kind this machine lacks; what it needs
- ``generate``: completions from a run's checkpoint or a Hugging Face directory
- ``export``: a run's checkpoint as a Hugging Face directory
- ``plot``: runs' loss, throughput and MFU side by side
- ``from_axolotl``: an Axolotl YAML config as an ndjax config file

A verb defines its absl flags in ``define_flags()``, called by ``main()``, never on
import: verbs share flag names (``--step``, ``--devices``, ``--config``) and absl
refuses a flag defined twice in one process, so a test or a script that imports two
verbs would fail. ``--help`` prints the shim's docstring (absl reads ``__main__``'s)
and the flags ``ndjax.runtime.cli.show_in_help`` lists for it.
"""
