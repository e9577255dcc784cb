"""An independent, slow, float64 implementation of the gradient filter's
formulas (docs/gradient_filter.md).

Written from the equations with explicit loops over patches and
kernel taps (no pooling, no convolution ops), so that the fast operator in
``mmseg_gf.ops`` is checked against the math rather than against itself.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor


def _axis(in_size: int, out_size: int, k: int, s: int, p: int, d: int,
          r: int):
    num = -(-out_size // r)
    start = ((k - 1) * d) // 2 - p
    pooled_dilation = d // (r * s)
    if k == 1 or pooled_dilation == 0:
        shifts = [0] * k
    else:
        shifts = [(u - (k - 1) // 2) * pooled_dilation for u in range(k)]
    out_ranges = [(i * r, min((i + 1) * r, out_size)) for i in range(num)]
    in_ranges = [(max(i * r * s + start, 0),
                  min(i * r * s + start + r * s, in_size))
                 for i in range(num)]
    return num, shifts, out_ranges, in_ranges


def reference_gradients(
        x: Tensor, weight: Tensor, grad_out: Tensor, stride: Tuple[int, int],
        padding: Tuple[int, int], dilation: Tuple[int, int], groups: int,
        radius: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Return ``(g_x, g_W, g_b)`` of docs/gradient_filter.md, all float64."""
    x, weight, grad_out = x.double(), weight.double(), grad_out.double()
    n, ci, h, w = x.shape
    co, ci_g, kh, kw = weight.shape
    co_g = co // groups
    _, _, ho, wo = grad_out.shape
    nh, shifts_h, out_h, in_h = _axis(h, ho, kh, stride[0], padding[0],
                                      dilation[0], radius)
    nw, shifts_w, out_w, in_w = _axis(w, wo, kw, stride[1], padding[1],
                                      dilation[1], radius)
    scale = 1.0 / (stride[0] * stride[1])

    # Step 1: patch means of g_y; forward: patch sums of x.
    g_mean = torch.zeros(n, co, nh, nw, dtype=torch.float64)
    x_sum = torch.zeros(n, ci, nh, nw, dtype=torch.float64)
    for a in range(nh):
        for b in range(nw):
            (i0, i1), (j0, j1) = out_h[a], out_w[b]
            g_mean[:, :, a, b] = grad_out[:, :, i0:i1, j0:j1].mean(dim=(2, 3))
            (h0, h1), (w0, w1) = in_h[a], in_w[b]
            if h1 > h0 and w1 > w0:
                x_sum[:, :, a, b] = x[:, :, h0:h1, w0:w1].sum(dim=(2, 3))

    g_x_pooled = torch.zeros(n, ci, nh, nw, dtype=torch.float64)
    g_w = torch.zeros_like(weight)
    for grp in range(groups):
        outs = slice(grp * co_g, (grp + 1) * co_g)
        ins = slice(grp * ci_g, (grp + 1) * ci_g)
        for u in range(kh):
            for v in range(kw):
                tap = weight[outs, :, u, v]  # co_g x ci_g
                for a in range(nh):
                    for b in range(nw):
                        qa, qb = a + shifts_h[u], b + shifts_w[v]
                        if not (0 <= qa < nh and 0 <= qb < nw):
                            continue
                        g = g_mean[:, outs, a, b]  # n x co_g
                        # Step 3 (Eq. 3): channel mixing with the kernel.
                        g_x_pooled[:, ins, qa, qb] += scale * g @ tap
                        # Step 4 (Eq. 5): patch means times patch sums.
                        g_w[outs, :, u, v] += scale * (
                            g.t() @ x_sum[:, ins, qa, qb])

    g_x = torch.zeros_like(x)
    for a in range(nh):
        for b in range(nw):
            (h0, h1), (w0, w1) = in_h[a], in_w[b]
            if h1 > h0 and w1 > w0:
                g_x[:, :, h0:h1, w0:w1] = g_x_pooled[:, :, a, b, None, None]
    g_b = grad_out.sum(dim=(0, 2, 3))
    return g_x, g_w, g_b


def exact_gradients(x: Tensor, weight: Tensor, grad_out: Tensor,
                    stride, padding, dilation, groups: int,
                    bias: Optional[Tensor] = None):
    """Exact (vanilla) gradients of ``F.conv2d`` in float64, for limits."""
    x = x.double().detach().requires_grad_()
    weight = weight.double().detach().requires_grad_()
    out = torch.nn.functional.conv2d(x, weight, None, stride, padding,
                                     dilation, groups)
    out.backward(grad_out.double())
    return x.grad, weight.grad
