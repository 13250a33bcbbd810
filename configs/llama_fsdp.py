"""FSDP (ZeRO-3): parameters, gradients and optimizer state sharded over all devices."""

from ndjax.config import default_config


def get_config():
    c = default_config()
    c.mesh.fsdp = -1
    c.rules = "default"
    return c
