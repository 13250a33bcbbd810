"""HSDP: FSDP inside groups of 4 devices, 2 replicas of those groups."""

from ndjax.config import default_config


def get_config():
    c = default_config()
    c.mesh.replica = 2
    c.mesh.fsdp = 4
    c.rules = "default"
    return c
