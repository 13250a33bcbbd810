"""Axolotl config fields -> ndjax config fields, for ``ndjax from_axolotl``."""
