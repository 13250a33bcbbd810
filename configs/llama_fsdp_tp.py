"""FSDP x tensor parallelism (the default experiment): tiny Llama, 4 x 2 devices."""

from ndjax.config import default_config


def get_config():
    c = default_config()
    c.mesh.fsdp = 4
    c.mesh.tensor = 2
    c.rules = "default"
    return c
