"""What a frozen transformer block keeps for backward: the minimum.

Written-out attention keeps its ``L x S`` probabilities per head where
SDPA keeps ``q``, ``k``, ``v``, the output and a logsumexp; a frozen
``LayerNorm`` keeps its mean too (:class:`FrozenLayerNormFunction`
recomputes it); DropPath keeps a float per sample (one bit does:
:class:`BitMaskDropPathFunction`). Pure PyTorch; wired in by
:mod:`mmseg_gf.models.lean_transformer`.
"""
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import Function

from ..backend import dispatch
from ..bit_mask import masks as bit_mask, gpu as triton_bit_mask
from ..frozen_norm import gpu as triton_norm
from .functions import FrozenLinearFunction

__all__ = ['FrozenLayerNormFunction', 'BitMaskDropPathFunction',
           'frozen_linear', 'split_heads', 'merge_heads',
           'multihead_attention', 'attention_kept_elements']


def _check_version(tensor: Optional[Tensor], version: int) -> None:
    # version -1: not recorded (torch.compile, where the compiled graph's
    # autograd node saves the parameters its backward reads, and autograd
    # checks those)
    if tensor is not None and version != -1 and tensor._version != version:
        raise RuntimeError(
            'a frozen parameter of a lean layer was modified in place '
            f'between its forward and backward (version {version} -> '
            f'{tensor._version})')


class FrozenLayerNormFunction(Function):
    """``layer_norm`` with frozen weight and bias, keeping its input and
    ``rstd``.

    The forward is ``torch.native_layer_norm`` (bit for bit); the backward
    recomputes the mean and calls ``native_layer_norm_backward`` (~1 ulp of
    autograd's) or one Triton launch. Weight and bias are referenced and
    version-checked like saved tensors.
    """

    @staticmethod
    def forward(ctx, x: Tensor, shape: Sequence[int],
                weight: Optional[Tensor], bias: Optional[Tensor],
                eps: float) -> Tensor:
        out, _, rstd = torch.native_layer_norm(x, list(shape), weight, bias,
                                               eps)
        ctx.save_for_backward(x, rstd)
        ctx.shape = list(shape)
        ctx.params = (weight, bias)
        ctx.versions = tuple(
            -1 if p is None or torch.compiler.is_compiling() else p._version
            for p in (weight, bias))
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, rstd = ctx.saved_tensors
        weight, bias = ctx.params
        for param, version in zip(ctx.params, ctx.versions):
            _check_version(param, version)
        if dispatch.choose('frozen_layer_norm', x, len(
                ctx.shape)).implementation.name == 'triton':
            return (triton_norm.frozen_layer_norm_backward(
                grad, x, rstd, weight, len(ctx.shape)), None, None, None,
                None)
        dims = tuple(range(x.dim() - len(ctx.shape), x.dim()))
        mean = x.to(rstd.dtype).mean(dims, keepdim=True)
        g_x = torch.ops.aten.native_layer_norm_backward(
            grad.contiguous(), x, ctx.shape, mean, rstd, weight, bias,
            [True, False, False])[0]
        return g_x, None, None, None, None


class BitMaskDropPathFunction(Function):
    """mmcv's ``drop_path`` keeping one bit per sample (its output bit for
    bit); the backward ``g.div(keep_prob) * noise`` is rebuilt from the bits.
    """

    @staticmethod
    def forward(ctx, x: Tensor, drop_prob: float) -> Tensor:
        keep_prob = 1 - drop_prob
        shape = (x.shape[0], ) + (1, ) * (x.ndim - 1)
        noise = (keep_prob + torch.rand(shape, dtype=x.dtype,
                                        device=x.device)).floor()
        ctx.save_for_backward(bit_mask.pack(noise, 0.0))
        ctx.keep_prob = keep_prob
        ctx.noise_shape = shape
        return x.div(keep_prob) * noise

    @staticmethod
    def backward(ctx, grad: Tensor):
        bits, = ctx.saved_tensors
        if dispatch.choose('bit_mask', grad).implementation.name == \
                'triton':  # the same numbers, one launch
            return triton_bit_mask.apply_per_sample(grad, bits,
                                                    ctx.keep_prob), None
        keep = bit_mask.unpack(bits, ctx.noise_shape).to(grad.dtype)
        return grad.div(ctx.keep_prob) * keep, None


def frozen_linear(x: Tensor, weight: Tensor,
                  bias: Optional[Tensor]) -> Tensor:
    """``F.linear`` keeping no tensor when ``weight`` and ``bias`` are
    frozen and ``x`` needs a gradient (autograd's transposed view keeps the
    whole Parameter's storage); otherwise ``F.linear`` itself.
    """
    frozen = not weight.requires_grad and (bias is None
                                           or not bias.requires_grad)
    if not (frozen and torch.is_grad_enabled() and x.requires_grad):
        return F.linear(x, weight, bias)
    return FrozenLinearFunction.apply(
        x, weight, lambda t: F.linear(t, weight, bias))


def split_heads(t: Tensor, num_heads: int) -> Tensor:
    b, n, e = t.shape
    return t.view(b, n, num_heads, e // num_heads).transpose(1, 2)


def merge_heads(t: Tensor) -> Tensor:
    b, h, n, d = t.shape
    return t.transpose(1, 2).reshape(b, n, h * d)


def multihead_attention(query: Tensor, key: Tensor, value: Tensor,
                        num_heads: int, q_proj: tuple,
                        kv_proj: Optional[tuple], k_proj: Optional[tuple],
                        v_proj: Optional[tuple], out_proj: tuple) -> Tensor:
    """``nn.MultiheadAttention``'s computation (batch first, no masks, no
    dropout) with frozen projections, through SDPA.

    Args:
        query: ``(B, L, E)``; key, value: ``(B, S, E)``.
        q_proj, out_proj: ``(weight, bias)`` pairs (bias may be None).
        kv_proj: key and value projections stacked, when ``key is value``;
            else None and ``k_proj``, ``v_proj``.

    Returns:
        ``(B, L, E)``; what it keeps: :func:`attention_kept_elements`.
    """
    q = frozen_linear(query, *q_proj)
    if kv_proj is not None:
        k, v = frozen_linear(key, *kv_proj).chunk(2, dim=-1)
    else:
        k = frozen_linear(key, *k_proj)
        v = frozen_linear(value, *v_proj)
    out = F.scaled_dot_product_attention(split_heads(q, num_heads),
                                         split_heads(k, num_heads),
                                         split_heads(v, num_heads))
    return frozen_linear(merge_heads(out), *out_proj)


def attention_kept_elements(batch: int, q_len: int, kv_len: int, dim: int,
                            num_heads: int) -> dict:
    """Elements SDPA keeps for one call (besides a mask): ``{'qkv': B (L + 2 S)
    E, 'out': B L E, 'logsumexp': B heads L}``.
    """
    return {'qkv': batch * (q_len + 2 * kv_len) * dim,
            'out': batch * q_len * dim,
            'logsumexp': batch * num_heads * q_len}

