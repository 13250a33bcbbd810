"""FSDP x tensor parallelism on 4 x 2 devices: the tiny Mixtral (8 experts, the top 2
per token; each expert's width split over tensor, every expert on every device).

    python train.py --config=configs/mixtral_fsdp_tp.py
    python train.py --config=configs/mixtral_fsdp_tp.py --config.model.init_from=DIR

DIR: a transformers-saved directory of the family (its config.json sets the model).
"""

from ndjax.config import default_config


def get_config():
    c = default_config()
    c.model.family = "mixtral"
    c.mesh.fsdp = 4
    c.mesh.tensor = 2
    c.rules = "default"
    c.train.seq_len = 128
    return c
