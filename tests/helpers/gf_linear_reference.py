"""An independent, slow, float64 implementation of the gradient-filtered
linear layer's formulas (docs/gradient_filter.md#linear-layers-on-token-grids).

Written from the equations with explicit loops over patches and lists of
token indices (no pooling, no reshape-into-patches), so that
``mmseg_gf.ops.linear.function`` is checked against the math rather
than against itself.
"""

from typing import List, Tuple

import torch
from torch import Tensor


def _to_token_rows(t: Tensor, layout: str, token_dim: int) -> Tensor:
    """``t`` as ``(tokens, others, C)``: the grid's tokens (extra tokens
    first, then row-major) on axis 0, every other axis but the last on 1."""
    if layout == 'hwc':
        moved = t.movedim((token_dim, token_dim + 1), (0, 1))
        return moved.reshape(moved.shape[0] * moved.shape[1], -1,
                             t.shape[-1])
    moved = t.movedim(token_dim, 0)
    return moved.reshape(moved.shape[0], -1, t.shape[-1])


def _from_token_rows(rows: Tensor, like: Tensor, layout: str,
                     token_dim: int) -> Tensor:
    """Inverse of :func:`_to_token_rows` for a tensor shaped like ``like``."""
    if layout == 'hwc':
        moved_shape = like.movedim((token_dim, token_dim + 1),
                                   (0, 1)).shape
        return rows.reshape(moved_shape).movedim((0, 1),
                                                 (token_dim, token_dim + 1))
    moved_shape = like.movedim(token_dim, 0).shape
    return rows.reshape(moved_shape).movedim(0, token_dim)


def patches(height: int, width: int, extra: int,
            radius: int) -> List[List[int]]:
    """Token indices (extra tokens first, then the grid row-major) of every
    ``r x r`` patch; the last patch along an axis may be short."""
    out = []
    for top in range(0, height, radius):
        for left in range(0, width, radius):
            out.append([
                extra + i * width + j
                for i in range(top, min(top + radius, height))
                for j in range(left, min(left + radius, width))
            ])
    return out


def reference_linear_gradients(x: Tensor, weight: Tensor, grad_out: Tensor,
                               height: int, width: int, extra: int,
                               layout: str, token_dim: int, radius: int,
                               trailing: int = 0
                               ) -> Tuple[Tensor, Tensor, Tensor]:
    """``(g_x, g_W, g_b)`` of the filtered linear layer, float64;
    ``extra`` leading and ``trailing`` tokens lie on no grid."""
    x, weight, grad_out = x.double(), weight.double(), grad_out.double()
    xr = _to_token_rows(x, layout, token_dim)  # T x M x Ci
    gr = _to_token_rows(grad_out, layout, token_dim)  # T x M x Co
    g_x = torch.zeros_like(xr)
    g_w = torch.zeros_like(weight)
    no_grid = list(range(extra)) + list(
        range(extra + height * width, extra + height * width + trailing))
    for t in no_grid:  # extra tokens: the exact rules
        g_x[t] = gr[t] @ weight
        g_w += gr[t].t() @ xr[t]
    for idx in patches(height, width, extra, radius):
        g_mean = gr[idx].mean(dim=0)  # M x Co, step 1
        x_sum = xr[idx].sum(dim=0)  # M x Ci, the forward's patch sums
        for t in idx:  # step 3, broadcast
            g_x[t] = g_mean @ weight
        g_w += g_mean.t() @ x_sum  # step 4
    g_b = gr.sum(dim=(0, 1))
    return _from_token_rows(g_x, x, layout, token_dim), g_w, g_b


def patch_average(grad_out: Tensor, height: int, width: int, extra: int,
                  layout: str, token_dim: int, radius: int,
                  trailing: int = 0) -> Tensor:
    """``M g``: every grid token's gradient replaced by its patch's mean,
    extra tokens unchanged (a self-adjoint projection)."""
    gr = _to_token_rows(grad_out.double(), layout, token_dim).clone()
    for idx in patches(height, width, extra, radius):
        gr[idx] = gr[idx].mean(dim=0, keepdim=True)
    return _from_token_rows(gr, grad_out, layout, token_dim)


def reference_filtered_linear(x: Tensor, weight: Tensor, bias, grid,
                              token_dim: int, radius: int) -> Tensor:
    """``F.linear`` whose input and weight gradients are taken at the
    patch-averaged output gradient (:func:`patch_average`, the loops above)
    and whose bias gradient at the unfiltered one: the filtered layer's
    backward written with autograd, for whole-model references. ``grid`` is
    any object with the ``TokenGrid`` fields."""
    y = torch.nn.functional.linear(x, weight)
    if y.requires_grad:
        y.register_hook(lambda g: patch_average(
            g, grid.height, grid.width, grid.extra_tokens, grid.layout,
            token_dim, radius, grid.trailing_tokens).to(g.dtype))
    return y if bias is None else y + bias


def reference_attention(attention, query: Tensor, key: Tensor, value: Tensor,
                        query_grid, key_grid, radius: int) -> Tensor:
    """``nn.MultiheadAttention``'s output (no masks, no dropout) with its
    four projections filtered as :func:`reference_filtered_linear`, the
    attention itself written out (softmax of scaled dot products)."""
    if attention.batch_first:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    e, heads = attention.embed_dim, attention.num_heads
    d = e // heads
    ws = attention.in_proj_weight.split(e)
    b = attention.in_proj_bias
    bs = (None, ) * 3 if b is None else b.split(e)

    def project(x, i, grid):
        return reference_filtered_linear(x, ws[i], bs[i], grid, 0, radius)

    q = project(query, 0, query_grid)
    k = project(key, 1, key_grid)
    v = project(value, 2, key_grid)
    tgt, batch, _ = q.shape
    q, k, v = (t.reshape(t.shape[0], batch * heads, d).transpose(0, 1)
               for t in (q, k, v))
    weights = torch.softmax(q @ k.transpose(1, 2) / d**0.5, dim=-1)
    out = (weights @ v).transpose(0, 1).reshape(tgt, batch, e)
    out = reference_filtered_linear(out, attention.out_proj.weight,
                                    attention.out_proj.bias, query_grid, 0,
                                    radius)
    return out.transpose(0, 1) if attention.batch_first else out
