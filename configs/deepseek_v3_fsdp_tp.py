"""FSDP x tensor parallelism on 4 x 2 devices: the tiny DeepSeek V3 (latent attention, a
dense first layer, 8 experts in 4 groups, the top 2 per token from the best 2 groups, a
shared expert, the load-balancing bias moving after every step; each expert's width and
the heads split over tensor).

    python train.py --config=configs/deepseek_v3_fsdp_tp.py
    python train.py --config=configs/deepseek_v3_fsdp_tp.py --config.model.init_from=DIR

DIR: a transformers-saved directory of the family (DeepSeek V3, Kimi K2 or Moonlight; its
config.json sets the model).
"""

from ndjax.config import default_config


def get_config():
    c = default_config()
    c.model.family = "deepseek_v3"
    c.mesh.fsdp = 4
    c.mesh.tensor = 2
    c.rules = "default"
    c.train.seq_len = 128
    return c
