"""What several families' grid rules share: reading ``hw_shape`` from a
block's call, a conv's output size, the spatial-reduction attention
block (Segformer's MiT layer and Twins' GSA layer have the same one), and
a plain ViT's layers on the patch embedding's grid plus leading cls tokens
(mmseg's ``VisionTransformer`` and ``BEiT`` / ``MAE``)."""
import functools
from typing import Tuple

from torch import nn

from ....ops.linear.token_grid import TokenGrid
from ...gf_linear import TokenGridSource
from ..sites import join

__all__ = ['hw_arg', 'conv_out', 'pair', 'hw_grid', 'spatial_reduction_layer',
           'embedded_token_layers']


def hw_arg(args: tuple, kwargs: dict, name: str,
           index: int) -> Tuple[int, int]:
    """``(H, W)`` a block is called with: keyword ``name`` or positional
    argument ``index``."""
    hw = kwargs[name] if name in kwargs else args[index]
    return int(hw[0]), int(hw[1])


def pair(value) -> Tuple[int, int]:
    """An int or a pair as a pair (mmcv's kernel / stride arguments)."""
    return (value, value) if isinstance(value, int) else tuple(value)


def conv_out(size: int, conv: nn.Module, axis: int) -> int:
    """A conv's output size along ``axis`` for an input of ``size``."""
    k, s = conv.kernel_size[axis], conv.stride[axis]
    p, d = conv.padding[axis], conv.dilation[axis]
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def hw_grid(module, args, kwargs) -> tuple:
    """The grid of a block called as ``forward(x, hw_shape)``."""
    return (TokenGrid(*hw_arg(args, kwargs, 'hw_shape', 1)), )


def _key_grid(attention: nn.Module, hw: Tuple[int, int]) -> TokenGrid:
    """The key / value grid of Segformer's efficient (Twins' global
    sub-sampled) attention: the output of its ``sr`` conv when
    ``sr_ratio > 1``, else the query's grid."""
    if getattr(attention, 'sr_ratio', 1) > 1:
        sr = attention.sr
        return TokenGrid(conv_out(hw[0], sr, 0), conv_out(hw[1], sr, 1))
    return TokenGrid(*hw)


def _reduced_grids(module, args, kwargs) -> tuple:
    hw = hw_arg(args, kwargs, 'hw_shape', 1)
    return TokenGrid(*hw), _key_grid(module.attn, hw)


def spatial_reduction_layer(bindings, path: str, layer: nn.Module) -> None:
    """A layer called as ``forward(x, hw_shape)`` whose attention
    (``layer.attn.attn``) reads keys on the grid of its ``sr`` conv."""
    rule = type(layer).__name__
    tokens = TokenGridSource(name=path)
    keys = TokenGridSource(name=f'{path}.attn.sr')

    bindings.set_around(layer, _reduced_grids, (tokens, keys))
    bindings.bind_layer(f'{path}.attn.attn', tokens, keys, 1, rule)
    bindings.bind_all(layer, path, tokens, rule)


def _embedded_grid(extra: int, module, args, output) -> tuple:
    _, hw = output
    return (TokenGrid(int(hw[0]), int(hw[1]), extra_tokens=extra), )


def _no_grid(module, args, kwargs) -> tuple:
    return (None, )


def embedded_token_layers(bindings, path: str, backbone: nn.Module,
                          extra: int) -> None:
    """A backbone whose ``patch_embed`` returns ``(tokens, hw_shape)`` and
    whose ``layers`` all see ``extra`` leading tokens (cls) before the
    ``H*W`` patch tokens: every Linear / attention under ``layers`` on that
    grid, set when the patch embedding returns, cleared around the
    backbone's call."""
    tokens = TokenGridSource(name=f'{path}.patch_embed')
    bindings.set_after(backbone.patch_embed,
                       functools.partial(_embedded_grid, extra), (tokens, ))
    bindings.set_around(backbone, _no_grid, (tokens, ))
    bindings.bind_all(backbone.layers, join(path, 'layers'), tokens,
                      type(backbone).__name__)
