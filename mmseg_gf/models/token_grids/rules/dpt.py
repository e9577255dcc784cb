"""Grid rule of DPT's ``ReassembleBlocks``
(mmseg/models/decode_heads/dpt_head.py): with ``readout_type='project'``,
input ``i`` is a ViT feature map ``(B, C, H, W)`` and its cls token
``(B, C)``; ``readout_projects[i]`` (a Linear, then a GELU) maps
``cat(tokens, cls)`` of its ``H*W`` tokens, the cls token copied onto every
one of them along the channels. Its tokens are the map's ``H x W`` grid
and nothing else (the cls token adds channels, not tokens). The other
readout types have no Linear.
"""
from mmseg.models.decode_heads.dpt_head import ReassembleBlocks
from torch import nn

from ....ops.linear.token_grid import TokenGrid
from ...gf_linear import TokenGridSource
from ..registry import register_grid_rule
from ..sites import join

__all__ = ['reassemble_blocks']


def _readout_grids(module, args, kwargs) -> tuple:
    """The grid of each input's feature map (``inputs[i][0]``)."""
    inputs = kwargs['inputs'] if 'inputs' in kwargs else args[0]
    return tuple(TokenGrid(int(x[0].shape[-2]), int(x[0].shape[-1]))
                 for x in inputs)


@register_grid_rule(ReassembleBlocks)
def reassemble_blocks(bindings, path: str, blocks: nn.Module) -> None:
    """``ReassembleBlocks(inputs)``: ``readout_projects[i]``'s Linear on
    the grid of ``inputs[i]``'s feature map (set around the call: the
    head calls the block as a module)."""
    if blocks.readout_type != 'project':
        return
    projects = blocks.readout_projects
    sources = tuple(TokenGridSource(name=f'{path} input {i}')
                    for i in range(len(projects)))
    bindings.set_around(blocks, _readout_grids, sources)
    for i, source in enumerate(sources):
        bindings.bind_all(projects[i], join(path, f'readout_projects.{i}'),
                          source, type(blocks).__name__)
