"""3D: replica x fsdp x tensor = 2 x 2 x 2."""

from ndjax.config import default_config


def get_config():
    c = default_config()
    c.mesh.replica = 2
    c.mesh.fsdp = 2
    c.mesh.tensor = 2
    c.rules = "default"
    return c
