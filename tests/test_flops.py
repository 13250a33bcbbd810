import pytest

from ndjax.flops import flops_per_token, peak_tflops
from ndjax.models.llama import LlamaConfig


def test_flops_per_token_by_hand():
    cfg = LlamaConfig(vocab_size=100, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=16)
    seq = 5
    # Per layer: q 8x8=64, k 8x4=32, v 32, o 64, gate/up/down 3x8x16=384 -> 576.
    matmul_params = 2 * 576
    head = 8 * 100
    # Causal: query i sees i keys (1..5) -> 15 pairs per head; QK^T + PV = 2 x
    # (2 x head_dim) FLOPs per pair forward, x3 for training.
    attention = 2 * 2 * 15 * (2 * 2 * 4) * 3 / seq   # layers x heads x pairs x flops, per token
    expected = 6 * matmul_params + 6 * head + attention
    assert flops_per_token(cfg, seq) == pytest.approx(expected)


@pytest.mark.parametrize("kind, peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA B200", 2250.0), ("cpu", None), ("TFRT_CPU_0", None),
])
def test_peak_table(kind, peak):
    assert peak_tflops(kind) == peak


def test_peak_override():
    assert peak_tflops("cpu", override=1.5) == 1.5
