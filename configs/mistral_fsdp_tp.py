"""FSDP x tensor parallelism on 4 x 2 devices: the tiny Mistral (every layer a
48-token sliding window).

    python train.py --config=configs/mistral_fsdp_tp.py
    ndjax plan --config=configs/mistral_fsdp_tp.py --devices=64 \\
        --config.model.preset=mistral_7b_v0_1
    python train.py --config=configs/mistral_fsdp_tp.py --config.model.init_from=DIR

DIR: a transformers-saved directory of the family (its config.json sets the model).
"""

from ndjax.config import default_config


def get_config():
    c = default_config()
    c.model.family = "mistral"
    c.mesh.fsdp = 4
    c.mesh.tensor = 2
    c.rules = "default"
    c.train.seq_len = 128
    return c
