"""The forward outputs and the backward of an autograd Function that takes
its gradients in the forward.

Such a Function (:mod:`.loss_gradients`, :mod:`.fused_classifier`, the lean
OHEM head's in :mod:`mmseg_gf.models.lean_ohem`) keeps, instead of its
inputs, the gradients of its outputs w.r.t. them; its backward only scales
them by the incoming gradients and sums: an output ``L_k`` with incoming
gradient ``c_k`` contributes ``c_k * dL_k/dz`` (the chain rule, so the
sum is the exact gradient whatever ``c_k`` is). The helpers here are that
shared part: which gradients are kept and of which (output, input) pair
(:func:`flatten_gradients`), their scaled sums per input
(:func:`recombine_gradients`, :func:`scaled_sum`), the factors of gradient
bases shared by several outputs (:func:`basis_scales`), and the forward's
outputs as the Function must return them (:func:`function_outputs`).
"""
from typing import Dict, List, Optional, Sequence, Tuple

from torch import Tensor

__all__ = ['basis_scales', 'flatten_gradients', 'function_outputs',
           'recombine_gradients', 'scaled_sum']


def scaled_sum(terms: Sequence[Tuple[Tensor, Tensor]],
               like: Tensor) -> Tensor:
    """``sum(scale * tensor)`` in float32 (at least), cast to ``like``'s
    dtype: the kept gradients times the incoming ones."""
    total = None
    for scale, tensor in terms:
        part = tensor * scale
        total = part if total is None else total + part
    return total.to(like.dtype)


def flatten_gradients(grads: Dict[str, Tuple[Optional[Tensor], ...]],
                      keys: List[str]
                      ) -> Tuple[List[Tuple[int, int]], List[Tensor]]:
    """The gradients that exist, and ``(output index, logits index)`` of
    each: what a backward needs to scale them."""
    layout, kept = [], []
    for key, per_logit in grads.items():
        for j, g in enumerate(per_logit):
            if g is not None:
                layout.append((keys.index(key), j))
                kept.append(g)
    return layout, kept


def recombine_gradients(layout: Sequence[Tuple[int, int]],
                        kept: Sequence[Tensor],
                        grad_outputs: Sequence[Optional[Tensor]],
                        num_logits: int) -> Tuple[Optional[Tensor], ...]:
    """Each logits tensor's gradient: its kept gradients, each scaled by its
    output's incoming gradient, summed."""
    terms: List[List[Tuple[Tensor, Tensor]]] = [
        [] for _ in range(num_logits)]
    for (k, j), g in zip(layout, kept):
        if grad_outputs[k] is not None:
            terms[j].append((grad_outputs[k], g))
    return tuple(scaled_sum(t, t[0][1]) if t else None for t in terms)


def _storage_key(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _own_outputs(tensors: Sequence[Tensor],
                 inputs: Sequence[Optional[Tensor]] = ()) -> tuple:
    """``tensors`` as a Function's outputs: each one that is a view, or
    shares its storage with an input or an earlier output, copied (an
    in-place change of one output must not reach another or an input);
    the others returned as they are (a loss value computed in the forward:
    on a GPU a copy is one more launch per output)."""
    seen = {_storage_key(t) for t in inputs if t is not None}
    out = []
    for t in tensors:
        key = _storage_key(t)
        if t._is_view() or key in seen:
            t = t.clone()
            key = _storage_key(t)
        seen.add(key)
        out.append(t)
    return tuple(out)


def function_outputs(ctx, values: Dict[str, Tensor], differentiable,
                     inputs: Sequence[Optional[Tensor]] = ()) -> tuple:
    """The forward's outputs in key order (:func:`_own_outputs`), the
    non-differentiable marked. An output no gradient reaches (the
    accuracy) gets None in the backward, not a zero tensor made for it
    (a fill launch on a GPU): the backwards skip None."""
    ctx.set_materialize_grads(False)
    outputs = _own_outputs([values[k] for k in ctx.keys], inputs)
    ctx.mark_non_differentiable(
        *[v for k, v in zip(ctx.keys, outputs) if k not in differentiable])
    return outputs


def basis_scales(keys: Sequence[str],
                 mix: Dict[str, List[Tuple[int, float]]],
                 grad_outputs: Sequence[Optional[Tensor]]
                 ) -> Dict[int, Tensor]:
    """Basis index -> its factor in the gradient: the incoming gradients
    of the outputs that use it, times their factors."""
    scales: Dict[int, Tensor] = {}
    for key, grad in zip(keys, grad_outputs):
        if grad is None or key not in mix:
            continue
        for b, factor in mix[key]:
            part = grad * factor
            scales[b] = scales[b] + part if b in scales else part
    return scales
