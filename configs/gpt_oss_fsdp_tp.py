"""FSDP x tensor parallelism on 4 x 2 devices: the tiny GPT-OSS (8 experts, the top 2 per
token, attention sinks, a 16-token window every other layer; each expert's width and the
heads split over tensor).

    python train.py --config=configs/gpt_oss_fsdp_tp.py
    python train.py --config=configs/gpt_oss_fsdp_tp.py --config.model.init_from=DIR

DIR: a transformers-saved directory of the family (its config.json sets the model; the
Hub's MXFP4 experts are dequantized as they are read).
"""

from ndjax.config import default_config


def get_config():
    c = default_config()
    c.model.family = "gpt_oss"
    c.mesh.fsdp = 4
    c.mesh.tensor = 2
    c.rules = "default"
    c.train.seq_len = 128
    return c
