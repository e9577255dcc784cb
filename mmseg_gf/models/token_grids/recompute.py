"""Blocks built with ``with_cp=True``: the recompute reads its call's grids.

A block built with ``with_cp=True`` (Swin's, MiT's and ViT's layers) runs
``torch.utils.checkpoint.checkpoint(_inner_forward, x)``: the backward
recomputes ``_inner_forward`` without the block's hooks, so its Linears
would find their grids cleared, or set by another call. The bindings give
such a block (a rule's :attr:`~.registry.GridRule.checkpointed` class) a
forward of their own, :class:`CheckpointWithGrids`, that takes the
checkpoint in its place, on a function that first sets the grids of the
call being recomputed: every filtered Linear in it gets its true grid in
the recompute.
"""
from typing import Sequence

from torch import nn
from torch.utils.checkpoint import checkpoint

from ..gf_linear import TokenGridSource

__all__ = ['CheckpointWithGrids']


class CheckpointWithGrids:
    """The forward of a block that mmseg checkpoints with ``with_cp=True``,
    installed as the block's instance attribute ``forward``
    (:func:`mmseg_gf.patching.override`, undone by the bindings'
    ``remove``).

    mmseg's block (e.g. ``SwinBlock.forward``) checkpoints its inner
    forward when ``self.with_cp and x.requires_grad``, with torch's default
    (reentrant) checkpoint. This forward takes the same checkpoint under the
    same condition, of a function that sets the grids the block's Linears
    read to those of this call (captured now), runs the block's own forward
    with ``with_cp`` off, and restores the grids it found: the recompute in
    the backward runs that function too, so it reads this call's grids,
    whichever call ran last. Otherwise it is the block's own forward. An
    object, not a closure, so that ``copy.deepcopy`` of a model gives the
    copy's block and sources.
    """

    def __init__(self, block: nn.Module,
                 sources: Sequence[TokenGridSource]) -> None:
        self.block = block
        self.sources = tuple(sources)

    def __call__(self, x, *args, **kwargs):
        block = self.block
        forward = type(block).forward
        if not (block.with_cp and x.requires_grad):
            return forward(block, x, *args, **kwargs)
        grids = tuple(source.grid for source in self.sources)

        def recomputable(x):
            found = tuple(source.grid for source in self.sources)
            for source, grid in zip(self.sources, grids):
                source.set(grid)
            block.with_cp = False
            try:
                return forward(block, x, *args, **kwargs)
            finally:
                block.with_cp = True
                for source, grid in zip(self.sources, found):
                    source.set(grid)

        return checkpoint(recomputable, x, use_reentrant=True)
