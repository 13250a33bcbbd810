"""The decoder stack under full rematerialisation: keep each layer's input, nothing else.

``remat=full`` needs exactly one thing per layer for the backward pass: the
layer's input (the residual stream, in the compute dtype). ``jax.checkpoint``
inside ``lax.scan`` asks for that too, but XLA's CPU compiler cannot update a
bfloat16 stack in place and keeps a float32 copy of it beside the bfloat16 one
(the ``float-normalization-bf16`` pass): on CPU, where layouts are planned and
memory is checked ahead of time, a bfloat16 run then looks 3x bigger than it is
on a GPU. This scan saves the inputs itself, 16-bit floats bitcast to uint16,
which every backend stores as they are, and recomputes each layer in the
backward pass with ``jax.vjp``, one layer's activations at a time.

``offload=True`` (``model.remat=offload``) keeps those inputs in the host's pinned
memory instead of the GPU's: each is copied out as the forward pass leaves its
layer and back as the backward pass reaches it, so depth stops bounding the
sequence (Llama 3 8B at a million tokens on 8 GPUs: 32 GiB of layer inputs per
device). XLA's host offloader turns the copies into asynchronous transfers over
PCIe that overlap the layers' compute. On a CPU host memory is the device's
memory: the copies are no-ops and the step is ``full``'s, bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# (h, layer params, consts) -> (h, aux): aux a pytree of the layer's statistics (the MoE
# router's; {} for a dense layer), summed over the layers.
Layer = Callable[[jax.Array, Any, tuple], tuple[jax.Array, Any]]


def _to_bits(x: jax.Array) -> jax.Array:
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 2:
        return jax.lax.bitcast_convert_type(x, jnp.uint16)
    return x


def _from_bits(bits: jax.Array, dtype) -> jax.Array:
    return bits if bits.dtype == dtype else jax.lax.bitcast_convert_type(bits, dtype)


def _to_host(x: jax.Array) -> jax.Array:
    return jax.device_put(x, jax.memory.Space.Host)


def _to_device(x: jax.Array) -> jax.Array:
    return jax.device_put(x, jax.memory.Space.Device)


def _zero_cotangent(x: jax.Array) -> Any:
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


def _add(a: Any, b: Any) -> Any:
    return jax.tree.map(jnp.add, a, b)


def _parts(aux: dict, prefix: str | None) -> tuple[dict, dict]:
    """(the aux entries summed over layers, those kept per layer: keys with ``prefix``)."""
    kept = {k: v for k, v in aux.items() if prefix is not None and k.startswith(prefix)}
    return {k: v for k, v in aux.items() if k not in kept}, kept


def _vmapped_over(axes: tuple[str, ...]) -> contextlib.AbstractContextManager:
    """The mesh axes of the vmap (``spmd_axis_name``) a custom VJP's backward rule runs
    under, put back in jax's axis env: jax leaves them out while it batches the rule
    (``batching.batch_subtrace``, jax 0.10 to 0.12), so a shard_map differentiated in
    the rule and manual over them (the MoE's, under a pipeline: ``stage``) names them
    in its residuals' specs, and the vmap refuses those ("vmap spmd_axis_name cannot
    appear in shard_map out_specs")."""
    if not axes:
        return contextlib.nullcontext()
    from jax._src import core  # no public form: the forward pass gets this from vmap
    return core.add_spmd_axis_names(axes)


def scan_full_remat(layer: Layer | tuple[Layer, ...], h: jax.Array, params: Any,
                    consts: tuple, offload: bool = False, per_layer: Any = None,
                    kept_prefix: str | None = None, vmapped_over: tuple[str, ...] = ()
                    ) -> tuple[jax.Array, Any]:
    """``h`` through every layer of the stacked ``params`` (leading axis: layers) ->
    (the output, the layers' aux summed; but the aux entries whose keys start with
    ``kept_prefix``, statistics that take no gradient, each layer's stacked along their
    leading axis).

    ``layer`` may be a tuple of P layers (a period of different layers: Gemma 3's five
    local ones and a global one); then ``params`` is (groups, P, ...) and each scan step
    runs the P layers in turn. Each layer's input is saved, and the backward pass
    recomputes one layer at a time: every layer's forward runs once more, whatever P.

    ``consts`` (RoPE tables, segment ids) are the same for every layer and get no
    gradient. ``layer`` must not close over traced values. ``offload``: the saved
    inputs live in host memory between the passes. The aux sum's cotangent is every
    layer's aux cotangent; each recomputed layer takes it with its output's.
    ``vmapped_over``: the mesh axes a pipeline vmaps this over (``_vmapped_over``).
    """
    layers = layer if isinstance(layer, tuple) else (layer,)
    inner = isinstance(layer, tuple)

    def at(p, j):
        return jax.tree.map(lambda a: a[j], p) if inner else p

    # ``consts`` reach every function below as an argument, never from this scope: the
    # custom VJP's rules may run under other traces (a pipeline's vmap over stages).
    def consts_at(consts, extra, j):
        return consts if per_layer is None else (*consts, at(extra, j))

    def run_group(consts, carry, xs, keep):
        c, total = carry
        p, extra = xs
        saved, stats = [], []
        for j, f in enumerate(layers):
            saved.append(_to_bits(c))
            c, aux = f(c, at(p, j), consts_at(consts, extra, j))
            summed, each = _parts(aux, kept_prefix)
            total = _add(total, summed)
            stats.append(each)
        stats = jax.tree.map(lambda *a: jnp.concatenate(a), *stats)
        if not keep:
            return (c, total), stats
        kept = jnp.stack(saved) if inner else saved[0]
        return (c, total), (_to_host(kept) if offload else kept, stats)

    def zeros(h, params, consts, extra):
        first = jax.tree.map(lambda a: a[0], (params, extra))
        aux = jax.eval_shape(layers[0], h, at(first[0], 0), consts_at(consts, first[1], 0))[1]
        return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), _parts(aux, kept_prefix)[0])

    def flat(stats):  # (groups, layers of a group, ...) -> (layers, ...)
        return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), stats)

    @jax.custom_vjp
    def run(h, params, consts, extra):
        (c, total), stats = jax.lax.scan(lambda c, xs: run_group(consts, c, xs, False),
                                         (h, zeros(h, params, consts, extra)), (params, extra))
        return c, {**total, **flat(stats)}

    def forward(h, params, consts, extra):
        (c, total), (inputs, stats) = jax.lax.scan(
            lambda c, xs: run_group(consts, c, xs, True), (h, zeros(h, params, consts, extra)),
            (params, extra))
        return (c, {**total, **flat(stats)}), (inputs, params, consts, extra)

    def backward(saved, cotangents):
        inputs, params, consts, extra = saved
        g, g_aux = cotangents
        g_aux = _parts(g_aux, kept_prefix)[0]  # the per-layer statistics take none

        def step(g, group_inputs):
            bits, p, e = group_inputs
            if offload:
                bits = _to_device(bits)
            grads = [None] * len(layers)
            for j in reversed(range(len(layers))):
                x = _from_bits(bits[j] if inner else bits, h.dtype)
                if inner:
                    # The recomputations depend on no gradient: without the barrier XLA
                    # may run them ahead and keep several layers' activations at once
                    # (Gemma 3 12B at 32k tokens: 41.2 -> 38.6 GiB of temporaries).
                    x, g = jax.lax.optimization_barrier((x, g))
                c = consts_at(consts, e, j)

                def summed(x, q, f=layers[j], c=c):
                    h, aux = f(x, q, c)
                    return h, _parts(aux, kept_prefix)[0]
                with _vmapped_over(vmapped_over):
                    _, vjp = jax.vjp(summed, x, at(p, j))
                    g, grads[j] = vjp((g, g_aux))
            g_p = jax.tree.map(lambda *gs: jnp.stack(gs), *grads) if inner else grads[0]
            return g, g_p

        g_h, g_params = jax.lax.scan(step, g, (inputs, params, extra), reverse=True)
        return (g_h, g_params, jax.tree.map(_zero_cotangent, consts),
                jax.tree.map(_zero_cotangent, extra))

    run.defvjp(forward, backward)
    return run(h, params, consts, per_layer)
