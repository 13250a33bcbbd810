"""A roofline of one train step on GPUs that are not here: compute, then each collective.

The planner (``ndjax plan``) compiles the step for N simulated devices and hands
this module what the compiled module says: model FLOPs per device and every
collective with its bytes, group and executions per step. The estimate is

    compute       = model FLOPs per device x recompute factor / peak bf16 FLOP/s
    communication = sum over collectives of ring bytes sent per device / bandwidth
                    of the slowest link its group crosses (NVLink inside a node,
                    the network when the group spans nodes), x executions
                    + (model.remat=offload) 2 x the layer inputs offloaded per device
                    / PCIe bandwidth (out in the forward pass, back in the backward)
    step time     = compute + communication   (no overlap; an upper bound)
                    max(compute, communication) (perfect overlap; a lower bound)

Ring bytes are ``Collective.ring_bytes``: a ring all-gather or reduce-scatter
over g devices sends (g-1)/g of the whole array per device, an all-reduce twice
that, a collective-permute its block once. Latency per message, the NCCL
protocol, kernel launch gaps and how well XLA overlaps are all left out: the
figure ranks layouts against each other and is not a promise of a step time.

The recompute factor prices ``model.remat`` by the forward matmuls each policy
runs a second time in the backward pass (``recomputed_forward_flops``; what each
saves is ``ndjax.models.decoder.REMAT_POLICIES``): ``none`` reruns none, ``save_proj``
the attention's output projection, ``save_attn`` every projection but the MLP's
down, ``full`` those and attention itself. The down projection is never rerun:
its output feeds only the layer's output, which the backward pass does not read.
Given the model's own figure (``estimate``'s ``recompute_flops``) that is priced;
otherwise the policy's share of Llama 3 8B's step at 4096 tokens (``recompute_factor``).

Hardware figures are per GPU, from the vendors' data sheets: dense (no
sparsity) bf16 tensor-core peak; HBM capacity; NVLink bandwidth in one
direction (half the "bidirectional" figure NVIDIA quotes); the network as the
DGX/HGX reference design gives it, one 400 Gb/s (A100: 200 Gb/s) InfiniBand
adapter per GPU = 50 (25) GB/s. For ``model.remat=offload``: the node's system
memory per GPU (DGX A100 1 TB, H100/H200 2 TB, B200 4 TB, per 8 GPUs) and each
GPU's PCIe link to it in one direction (PCIe 4 x16: 32 GB/s; PCIe 5 x16: 64).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Chip:
    """What XLA's GPU compiler needs to know of a GPU to compile for it without one
    (``ndjax.hardware.gpu_target`` writes it as a ``GpuTargetConfigProto``): from the data
    sheets and the CUDA programming guide's table of compute capabilities."""

    sms: int                      # streaming multiprocessors
    fp32_per_sm: int              # FP32 cores per SM
    clock_ghz: float              # boost clock
    hbm_tbs: float                # HBM bandwidth, 1e12 bytes/s
    l2_mb: int                    # L2 cache, MiB
    smem_per_sm_kb: int           # shared memory per SM, KiB
    smem_per_block_optin_kb: int  # the most one block may opt in to, KiB
    device_name: str              # as the driver names it (jax's device_kind)


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    peak_tflops: float      # dense bf16, per GPU
    memory_gb: float        # HBM per GPU, 1e9 bytes
    nvlink_gbs: float       # GB/s per GPU in one direction, inside a node
    network_gbs: float      # GB/s per GPU across nodes
    compute_capability: str
    source: str
    chip: Chip
    # The host side, for model.remat=offload: the node's system memory per GPU and
    # each GPU's PCIe link to it, GB/s in one direction (the reference designs).
    host_memory_gb: float = 256.0
    pcie_gbs: float = 64.0

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * GB

    @property
    def host_memory_bytes(self) -> float:
        return self.host_memory_gb * GB

    def fits(self, device_bytes: float, host_bytes: float, fraction: float) -> bool:
        """Within ``fraction`` of the GPU's memory, and of the node's memory per GPU."""
        return (device_bytes <= self.memory_bytes * fraction
                and host_bytes <= self.host_memory_bytes * fraction)

    def offload_s(self, host_bytes: float) -> float:
        """Seconds to copy ``host_bytes`` out to the host and back over PCIe."""
        return 2 * host_bytes / (self.pcie_gbs * GB)


_HOPPER = dict(sms=132, fp32_per_sm=128, clock_ghz=1.98, l2_mb=50, smem_per_sm_kb=228,
               smem_per_block_optin_kb=227)
HARDWARE: dict[str, Hardware] = {
    "a100": Hardware("A100 SXM4 80GB", 312.0, 80.0, 300.0, 25.0, "8.0",
                     "NVIDIA A100 data sheet (312 TFLOPS bf16, 600 GB/s NVLink 3); DGX A100: "
                     "8x 200 Gb/s HDR InfiniBand",
                     Chip(sms=108, fp32_per_sm=64, clock_ghz=1.41, hbm_tbs=2.039, l2_mb=40,
                          smem_per_sm_kb=164, smem_per_block_optin_kb=163,
                          device_name="NVIDIA A100-SXM4-80GB"),
                     host_memory_gb=128.0, pcie_gbs=32.0),  # 1 TB per node; PCIe 4
    "h100": Hardware("H100 SXM5 80GB", 989.0, 80.0, 450.0, 50.0, "9.0",
                     "NVIDIA H100 data sheet (989 TFLOPS bf16 dense, 900 GB/s NVLink 4); "
                     "DGX H100: 8x 400 Gb/s NDR InfiniBand",
                     Chip(**_HOPPER, hbm_tbs=3.35, device_name="NVIDIA H100 80GB HBM3"),
                     host_memory_gb=256.0, pcie_gbs=64.0),  # DGX H100: 2 TB; PCIe 5
    "h200": Hardware("H200 SXM 141GB", 989.0, 141.0, 450.0, 50.0, "9.0",
                     "NVIDIA H200 data sheet (989 TFLOPS bf16 dense, 141 GB HBM3e, 900 GB/s "
                     "NVLink); DGX H200: 8x 400 Gb/s InfiniBand",
                     Chip(**_HOPPER, hbm_tbs=4.8, device_name="NVIDIA H200"),
                     host_memory_gb=256.0, pcie_gbs=64.0),  # DGX H200: 2 TB; PCIe 5
    "b200": Hardware("B200 180GB", 2250.0, 180.0, 900.0, 50.0, "10.0",
                     "NVIDIA B200 (2.25 PFLOPS bf16 dense, 4.5 sparse; 1.8 TB/s NVLink 5); DGX "
                     "B200 data sheet (1,440 GB HBM3e per 8 GPUs; 8x 400 Gb/s InfiniBand)",
                     Chip(sms=148, fp32_per_sm=128, clock_ghz=1.965, hbm_tbs=8.0, l2_mb=126,
                          smem_per_sm_kb=228, smem_per_block_optin_kb=227,
                          device_name="NVIDIA B200"),
                     host_memory_gb=512.0, pcie_gbs=64.0),  # DGX B200: 4 TB; PCIe 5
}

# The forward matmuls of a decoder layer that each remat policy runs again in the
# backward pass, because it does not save their output (REMAT_POLICIES' names):
# o's output (attn_block_out) rebuilds the residual stream that mlp_norm's backward
# reads; gate and up (mlp_gate, mlp_up) are the down projection's input; q, k, v
# (q_proj, k_proj, v_proj) attention's; and attention (attn_out, attn_lse) the
# output projection's input. Tested against the traced train step
# (tests/test_flops.py).
# MoE layers (ndjax.models.moe) rerun their experts' down projection too where they
# rerun gate and up (the routing weights' gradient reads each pair's output), and the
# router where nothing keeps its logits.
_MOE = ("expert_down", "router")
RERUN = {
    "none": (),
    "save_proj": ("o",),
    "save_attn": ("q", "k", "v", "o", "gate", "up", *_MOE),
    "full": ("q", "k", "v", "o", "gate", "up", *_MOE, "attention"),
    # full's, inputs on the host
    "offload": ("q", "k", "v", "o", "gate", "up", *_MOE, "attention"),
}


def recomputed_forward_flops(cfg: Any, seq_len: int, remat: str) -> dict[str, float]:
    """FLOPs per token that ``model.remat=remat`` runs again in the backward pass, by
    matmul (over all layers; a multiply-add is 2). ``cfg``: a ``DecoderConfig``.

    Attention is priced as ``ndjax.hardware.flops`` counts it, QK^T and PV over the causal
    half of the keys (a local layer's: those in its window); how much of it a kernel
    really reruns is the kernel's (the dense kernel reruns PV under full, and its
    QK^T under every policy, none too)."""
    from ndjax.models.decoder import keys_per_query, stacks

    d, hd, h, layers = cfg.dim, cfg.hd, cfg.n_heads, cfg.n_layers
    v_dim = (cfg.v_head_dim or hd) if cfg.kv_lora_rank else hd
    if cfg.kv_lora_rank:  # latent attention: each part with its latent's matmul
        nope, latent = hd - cfg.rope_head_dim, cfg.kv_lora_rank
        q = 2 * (d * cfg.q_lora_rank + cfg.q_lora_rank * h * hd if cfg.q_lora_rank
                 else d * h * hd)
        attention = {"q": q, "k": 2 * (d * (latent + cfg.rope_head_dim) + latent * h * nope),
                     "v": 2 * latent * h * v_dim}
    else:
        attention = {"q": 2 * d * h * hd, "k": 2 * d * cfg.n_kv_heads * hd,
                     "v": 2 * d * cfg.n_kv_heads * hd}
    attention["o"] = 2 * h * v_dim * d
    out = {part: float(layers * attention[part]) for part in RERUN[remat] if part in attention}
    for stack in stacks(cfg):  # (DeepSeek V3's dense first layers beside the MoE ones)
        # An MoE token runs through experts_per_token experts: their widths, summed.
        width = cfg.experts_per_token * cfg.expert_dim if stack.moe else cfg.ffn_dim
        mlp = {"gate": 2 * d * width, "up": 2 * d * width}
        if stack.moe:
            mlp.update(expert_down=2 * width * d, router=2 * d * cfg.n_experts)
        for part in RERUN[remat]:
            if part in mlp:
                out[part] = out.get(part, 0.0) + float(stack.count * mlp[part])
    if "attention" in RERUN[remat]:
        out["attention"] = float(sum(2 * h * (hd + v_dim) * keys_per_query(
            seq_len, cfg.spec(t).window) for t in cfg.types))
    return out


@functools.cache
def recompute_factor(remat: str) -> float:
    """(model FLOPs + what ``remat`` reruns) / model FLOPs, Llama 3 8B at 4096 tokens:
    the price of a policy when the model's own figure is not given. Across the Llama 3
    shapes the rerun matmuls are about the same share of a layer's (0.72-0.73 of its
    weights under save_attn), so the factor carries over roughly."""
    # Imported here: the model pulls in jax and flax, and this module is the light
    # table of hardware figures that gpu_target imports.
    from ndjax.hardware.flops import flops_per_token
    from ndjax.models.registry import config_from_preset

    cfg, seq = config_from_preset("llama", "llama3_8b"), 4096
    return 1.0 + sum(recomputed_forward_flops(cfg, seq, remat).values()) / flops_per_token(
        cfg, seq)


@dataclasses.dataclass(frozen=True)
class Link:
    """Bytes one device sends per step over one kind of link, by collective kind."""

    inside: dict[str, float]   # groups within one node
    across: dict[str, float]   # groups that span nodes

    @property
    def inside_bytes(self) -> float:
        return sum(self.inside.values())

    @property
    def across_bytes(self) -> float:
        return sum(self.across.values())


def nodes_of(group: tuple[int, ...], devices_per_node: int) -> int:
    """How many nodes a group of device positions (in jax.devices() order) spans."""
    return len({d // devices_per_node for d in group})


def traffic(collectives: list[dict], devices_per_node: int) -> Link:
    """Ring bytes per device per step, split by whether the group crosses nodes.

    ``collectives``: the planner's records, each with kind, ring_bytes (per
    execution), executed, and groups as device positions."""
    inside: dict[str, float] = {}
    across: dict[str, float] = {}
    for c in collectives:
        sent = c["ring_bytes"] * c["executed"]
        if not sent:
            continue
        spans = max(nodes_of(tuple(g), devices_per_node) for g in c["groups"])
        where = across if spans > 1 else inside
        where[c["kind"]] = where.get(c["kind"], 0.0) + sent
    return Link(inside, across)


@dataclasses.dataclass(frozen=True)
class Estimate:
    compute_s: float
    inside_s: float
    across_s: float
    tokens: int                # per step, all devices
    model_flops: float         # per step, all devices (6N-style, no recompute)
    devices: int
    peak_tflops: float
    # model.remat=offload: each device's layer inputs to the host and back over PCIe.
    host_s: float = 0.0

    @property
    def communication_s(self) -> float:
        return self.inside_s + self.across_s + self.host_s

    @property
    def serial_s(self) -> float:
        return self.compute_s + self.communication_s

    @property
    def overlapped_s(self) -> float:
        return max(self.compute_s, self.communication_s)

    def tokens_per_s(self, overlap: bool = False) -> float:
        return self.tokens / (self.overlapped_s if overlap else self.serial_s)

    def mfu(self, overlap: bool = False) -> float:
        seconds = self.overlapped_s if overlap else self.serial_s
        return self.model_flops / (seconds * self.devices * self.peak_tflops * 1e12)


def estimate(hw: Hardware, link: Link, model_flops: float, tokens: int, devices: int,
             remat: str, recompute_flops: float | None = None,
             host_bytes: float = 0.0, executed_flops: float | None = None) -> Estimate:
    """``model_flops``: training FLOPs of one step over all devices (ndjax.hardware.flops);
    ``recompute_flops``: what ``remat`` reruns in that step, all devices
    (``recomputed_forward_flops`` x tokens), else priced by ``recompute_factor``;
    ``host_bytes``: what each device offloads to host memory (out in the forward
    pass, back in the backward: twice over its PCIe link); ``executed_flops``: what
    the devices compute, all of them, where it is more than the model's and remat's
    (a pipeline's bubble: ``planner.executed_flops``). MFU counts ``model_flops``."""
    if recompute_flops is None:
        recompute_flops = model_flops * (recompute_factor(remat) - 1.0)
    if executed_flops is None:
        executed_flops = model_flops + recompute_flops
    compute = executed_flops / devices / (hw.peak_tflops * 1e12)
    return Estimate(compute_s=compute, inside_s=link.inside_bytes / (hw.nvlink_gbs * GB),
                    across_s=link.across_bytes / (hw.network_gbs * GB), tokens=tokens,
                    model_flops=model_flops, devices=devices, peak_tflops=hw.peak_tflops,
                    host_s=hw.offload_s(host_bytes))
