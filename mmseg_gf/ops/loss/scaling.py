"""The forward outputs and the backward of an autograd Function that takes
its gradients in the forward.

Such a Function keeps the gradients of its outputs instead of its inputs;
its backward scales them by the incoming gradients and sums, the exact
chain rule whatever those are. Shared here: which gradients are kept
(:func:`flatten_gradients`), their scaled sums (:func:`recombine_gradients`,
:func:`scaled_sum`, :func:`basis_scales`) and the forward's outputs
(:func:`function_outputs`).
"""
from typing import Dict, List, Optional, Sequence, Tuple

from torch import Tensor

__all__ = ['basis_scales', 'flatten_gradients', 'function_outputs',
           'recombine_gradients', 'scaled_sum']


def scaled_sum(terms: Sequence[Tuple[Tensor, Tensor]],
               like: Tensor) -> Tensor:
    """``sum(scale * tensor)`` in at least float32, cast to ``like``'s
    dtype.
    """
    total = None
    for scale, tensor in terms:
        part = tensor * scale
        total = part if total is None else total + part
    return total.to(like.dtype)


def flatten_gradients(grads: Dict[str, Tuple[Optional[Tensor], ...]],
                      keys: List[str]
                      ) -> Tuple[List[Tuple[int, int]], List[Tensor]]:
    """The gradients that exist and ``(output, logits)`` indices of each."""
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
    """Each logits tensor's gradient: its kept gradients, scaled, summed."""
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
    """``tensors`` as outputs: a view or one sharing storage with an input
    or an earlier output is copied (in-place changes must not reach another);
    the others are returned as they are (a copy is a launch on a GPU).
    """
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
    """The forward's outputs in key order, the non-differentiable marked; an
    output no gradient reaches gets None in the backward, not a zero fill.
    """
    ctx.set_materialize_grads(False)
    outputs = _own_outputs([values[k] for k in ctx.keys], inputs)
    ctx.mark_non_differentiable(
        *[v for k, v in zip(ctx.keys, outputs) if k not in differentiable])
    return outputs


def basis_scales(keys: Sequence[str],
                 mix: Dict[str, List[Tuple[int, float]]],
                 grad_outputs: Sequence[Optional[Tensor]]
                 ) -> Dict[int, Tensor]:
    """Basis index -> its factor: the incoming gradients of its outputs
    times their factors.
    """
    scales: Dict[int, Tensor] = {}
    for key, grad in zip(keys, grad_outputs):
        if grad is None or key not in mix:
            continue
        for b, factor in mix[key]:
            part = grad * factor
            scales[b] = scales[b] + part if b in scales else part
    return scales
