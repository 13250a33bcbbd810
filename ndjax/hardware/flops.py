"""Model FLOPs per token, peak TFLOP/s per device, and MFU.

Training FLOPs per token (forward + backward = 3 x forward, each multiply-add
counted as 2 FLOPs):

    6 * N_matmul                     # weights of the decoder blocks
  + 6 * dim * vocab                  # LM head (tied or not; the lookup is free)
  + 6 * n_layers * n_heads * head_dim * (seq_len + 1)   # attention, causal mask

where N_matmul = n_layers * (dim * head_dim * (2 n_heads + 2 n_kv_heads)
+ 3 * dim * ffn_dim), i.e. the non-embedding parameters less the norm scales. A
mixture-of-experts layer counts the parameters a token uses: its experts_per_token
experts (3 * dim * expert width each) and the router (dim * n_experts).
The attention term: per layer and head, QK^T and PV are each 2 * head_dim
FLOPs per (query, key) pair; under the causal mask a query sees on average
(seq_len + 1) / 2 keys; x3 for training gives 6 * head_dim * (seq_len + 1).
Packed documents attend to fewer keys than that; we count the causal row, as
is usual, so MFU is comparable across data sets. A layer with a sliding window
(Mistral, Gemma 3's local layers) counts the keys inside its window instead of
(seq_len + 1) / 2. Under LoRA the frozen weights (the LM head's too) count 4, not 6,
per parameter (no weight gradient), and the adapters 6 * rank * (in + out) each, so
MFU is the work a LoRA step does. Each family states its figure
(``registry.Family.flops_per_token``; every family uses ``decoder.train_flops_per_token``).

MFU = achieved model FLOP/s per device / peak dense bf16 FLOP/s of that device.
"""

from __future__ import annotations

from ndjax.models import registry
from ndjax.models.decoder import DecoderConfig

# Dense (no sparsity) bf16 tensor-core peaks, TFLOP/s, from the vendors' data
# sheets. First match wins, so more specific names come first.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),       # SXM
    ("A100", 312.0),
    ("B200", 2250.0),
    ("L40S", 362.0),
)


def flops_per_token(cfg: DecoderConfig, seq_len: int) -> float:
    """Training FLOPs per token of ``cfg``'s family (see the module docstring)."""
    return registry.of(cfg).flops_per_token(cfg, seq_len)


def peak_tflops(device_kind: str, override: float | None = None) -> float | None:
    """Peak bf16 TFLOP/s of a device, or None where it is not known (CPUs)."""
    if override:
        return float(override)
    for name, peak in PEAK_TFLOPS:
        if name.lower() in device_kind.lower():
            return peak
    return None
