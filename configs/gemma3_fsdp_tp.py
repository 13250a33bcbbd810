"""FSDP x tensor parallelism on 4 x 2 devices: the tiny Gemma 3 text (8 layers: 5 local
with a 16-token window, 1 global, 2 local).

    python train.py --config=configs/gemma3_fsdp_tp.py
    ndjax plan --config=configs/gemma3_fsdp_tp.py --devices=64 \\
        --config.model.preset=gemma3_12b
    python train.py --config=configs/gemma3_fsdp_tp.py --config.model.init_from=DIR

DIR: a transformers-saved directory of the family (its config.json sets the model).
"""

from ndjax.config import default_config


def get_config():
    c = default_config()
    c.model.family = "gemma3"
    c.mesh.fsdp = 4
    c.mesh.tensor = 2
    c.rules = "default"
    c.train.seq_len = 128
    return c
