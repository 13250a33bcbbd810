"""Pure data parallelism: every device holds the whole model, batch split 8 ways."""

from ndjax.config import default_config


def get_config():
    c = default_config()
    c.mesh.replica = -1
    c.mesh.fsdp = 1
    c.rules = "default"
    return c
