"""Axolotl config fields -> ndjax config fields, for ``python -m ndjax.from_axolotl``."""
