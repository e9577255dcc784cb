"""Grid rule of ``BEiT`` (mmseg/models/backbones/beit.py) and of ``MAE``
(mmseg/models/backbones/mae.py, a ``BEiT`` with absolute position
embeddings and plain ``qkv`` biases): the patch embedding returns the
grid, every layer sees ``[cls] + H*W`` tokens (BEiT always prepends its
cls token), so ``qkv``, ``proj`` and the FFN's Linears lie on that grid
with one leading token kept exact. The relative position bias acts
inside the attention, between ``qkv`` and ``proj``, and changes no
Linear's tokens.

BEiT's attention built with ``bias='qv_bias'`` (mmseg's BEiT default, and
its configs') computes ``qkv`` with ``F.linear`` on the ``qkv`` Linear's
weight, never calling the module: the rule gives it a forward that calls
it (:class:`QVBiasThroughModule`), so that the selection's trace counts it
and a filtered module in its place runs. mmseg's BEiT layers take no
``with_cp``: nothing is checkpointed.
"""
import functools

import torch
from mmseg.models.backbones.beit import BEiT, BEiTAttention
from torch import Tensor, nn

from ..registry import register_grid_rule
from .shared import embedded_token_layers

__all__ = ['QVBiasThroughModule', 'beit']


def _add_bias(bias: Tensor, module, args, output: Tensor) -> Tensor:
    return output + bias


class QVBiasThroughModule:
    """The forward of a ``BEiTAttention`` built with ``bias='qv_bias'``
    while its model's grids are bound.

    mmseg's forward computes ``F.linear(x, self.qkv.weight, cat(q_bias, 0,
    v_bias))``. This one runs mmseg's own forward on its other branch,
    ``self.qkv(x)`` (the Linear is built without a bias), with a forward
    hook on that call adding ``cat(q_bias, 0, v_bias)`` to its output:
    the same ``x W^T + b``, through the module, so a filtered module swapped
    in for ``qkv`` computes it and its weight's gradient, and ``q_bias`` /
    ``v_bias`` get the output's gradient summed over tokens, as before.
    The hook is registered on the module found at call time, so it
    survives the swap. An object holding the attention, so that
    ``copy.deepcopy`` of a model gives the copy's.
    """

    def __init__(self, attention: nn.Module) -> None:
        self.attention = attention

    def __call__(self, x: Tensor) -> Tensor:
        attn = self.attention
        bias = torch.cat((attn.q_bias, torch.zeros_like(attn.v_bias),
                          attn.v_bias))
        handle = attn.qkv.register_forward_hook(
            functools.partial(_add_bias, bias))
        attn.bias = True  # mmseg's branch that calls self.qkv(x)
        try:
            return type(attn).forward(attn, x)
        finally:
            attn.bias = 'qv_bias'
            handle.remove()


@register_grid_rule(BEiT)
def beit(bindings, path: str, backbone: nn.Module) -> None:
    """``BEiT`` / ``MAE``: the layers on the patch embedding's grid plus
    the leading cls token; each ``qv_bias`` attention's ``qkv`` called as
    a module (:class:`QVBiasThroughModule`)."""
    embedded_token_layers(bindings, path, backbone, 1)
    for layer in backbone.layers:
        attn = layer.attn
        if isinstance(attn, BEiTAttention) and attn.bias == 'qv_bias':
            bindings.replace_forward(attn, QVBiasThroughModule(attn))
