"""The one custom VJP of the attention kernels that bring their own backward pass.

A flash-style kernel (ring, tiled, cuDNN, Pallas) saves its output and the rows'
log-sum-exp for its backward pass. Inside a layer's ``jax.checkpoint`` with a
``save_only_these_names`` policy, a custom VJP's residuals are recomputed unless
they carry a ``checkpoint_name``: then the policy reruns the whole kernel forward in
the backward pass to rebuild them, one extra attention per layer and step, whatever
the policy says about attention. ``named_residuals`` names them ``attn_out`` and
``attn_lse`` for every kernel alike, so a remat policy means the same thing whichever
kernel runs (``ndjax.models.decoder.REMAT_POLICIES``; counted per kernel and policy in
tests/test_attention.py and, compiled for GPUs, tests/test_gpu_compile.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name

# The names of the residuals every fused kernel saves (Kernel.saves).
OUT, LSE = "attn_out", "attn_lse"
RESIDUALS = (OUT, LSE)
FORWARD_SCOPE = "attention_forward"


def named_residuals(forward: Callable[..., tuple[jax.Array, jax.Array, Any]],
                    backward: Callable[..., tuple[Any, ...]]) -> Callable[..., jax.Array]:
    """A kernel (``*args -> out``) with a custom VJP whose output and log-sum-exp
    residuals are named ``attn_out`` and ``attn_lse``.

    ``forward(*args) -> (out, lse, res)``: ``res`` is anything else the backward pass
    needs (a pytree; it may hold ``out`` and ``lse`` themselves, as the pullback of a
    library kernel does, and those leaves are replaced by the named ones, so that
    nothing unnamed keeps them). ``backward(args, out, lse, res, d_out)`` returns one
    cotangent per argument (None for integer ones, e.g. segment ids).
    """

    def run_forward(*args):
        # The scope marks the forward's work in a jaxpr, where a remat policy's
        # reruns are counted (tests/test_attention.py).
        with jax.named_scope(FORWARD_SCOPE):
            return forward(*args)

    @jax.custom_vjp
    def kernel(*args):
        return run_forward(*args)[0]

    def kernel_fwd(*args):
        out, lse, res = run_forward(*args)
        named = {id(out): checkpoint_name(out, OUT), id(lse): checkpoint_name(lse, LSE)}
        res = jax.tree.map(lambda x: named.get(id(x), x), res)
        return named[id(out)], (args, named[id(out)], named[id(lse)], res)

    def kernel_bwd(saved, d_out):
        return tuple(backward(*saved, d_out))

    kernel.defvjp(kernel_fwd, kernel_bwd)
    return kernel
