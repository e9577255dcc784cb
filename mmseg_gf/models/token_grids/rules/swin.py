"""Grid rules of ``SwinTransformer`` (mmseg/models/backbones/swin.py):
a ``SwinBlock`` is called with its ``hw_shape`` and computes its window
attention on fixed ``ws x ws`` windows; ``PatchMerging`` reduces onto the
merged grid."""
from mmseg.models.backbones.swin import SwinBlock
from mmseg.models.utils.embed import PatchMerging
from torch import nn

from ....ops.linear.token_grid import TokenGrid
from ...gf_linear import TokenGridSource
from ..registry import register_grid_rule
from .shared import hw_arg, hw_grid, pair


@register_grid_rule(SwinBlock, checkpointed=(SwinBlock, ))
def swin_block(bindings, path: str, block: nn.Module) -> None:
    """``SwinBlock(x, hw_shape)``: the FFN on ``hw_shape``, ``WindowMSA``'s
    ``qkv`` and ``proj`` on ``(B * windows, ws * ws, C)``, the window's
    grid."""
    rule = type(block).__name__
    tokens = TokenGridSource(name=path)
    bindings.set_around(block, hw_grid, (tokens, ))
    w_msa = block.attn.w_msa
    window = TokenGridSource(TokenGrid.windows(tuple(w_msa.window_size)),
                             name=f'{path}.attn.w_msa.window_size')
    for name in ('qkv', 'proj'):
        bindings.bind_layer(f'{path}.attn.w_msa.{name}', window, None, 1,
                            rule)
    bindings.bind_all(block, path, tokens, rule)


def _merged_grid(module, args, kwargs) -> tuple:
    h, w = hw_arg(args, kwargs, 'input_size', 1)
    if module.adap_padding:
        pad_h, pad_w = module.adap_padding.get_pad_shape((h, w))
        h, w = h + pad_h, w + pad_w
    sampler = module.sampler
    sizes = []
    for axis, size in enumerate((h, w)):
        k, s = pair(sampler.kernel_size)[axis], pair(sampler.stride)[axis]
        p, d = pair(sampler.padding)[axis], pair(sampler.dilation)[axis]
        sizes.append((size + 2 * p - d * (k - 1) - 1) // s + 1)
    return (TokenGrid(*sizes), )


@register_grid_rule(PatchMerging)
def patch_merging(bindings, path: str, merging: nn.Module) -> None:
    """``PatchMerging(x, input_size)``: ``reduction`` on the merged grid
    (adaptive padding, then the ``nn.Unfold`` sampler's output size)."""
    tokens = TokenGridSource(name=path)

    bindings.set_around(merging, _merged_grid, (tokens, ))
    bindings.bind_all(merging, path, tokens, type(merging).__name__)
