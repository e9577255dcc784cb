"""A GELU between two filtered layers that keeps the patch means of its
derivative (:mod:`mmseg_gf.ops.linear.patch_mean_activation`,
docs/gradient_filter.md#elementwise-ops-between-filtered-layers).

:func:`make_patch_mean_gelu` puts a mixin in front of an ``nn.GELU``'s own
class (``isinstance`` checks and ``state_dict`` keys stay torch's;
:func:`~.lean.make_plain` swaps it back) and gives it the partition its
input lies on, which the model's traced training step established
(``mmseg_gf.engine.patch_mean_activations``). Each call re-checks cheaply
that its input is still a filtered layer's output on that partition
(:func:`~mmseg_gf.ops.linear.patch_mean_activation.tagged_partition`: the filtered
layer's mark, void after an in-place change) and otherwise runs the plain
GELU, whose backward is exact.
"""
from typing import Optional

import torch
from torch import Tensor, nn

from ..ops.linear.patch_mean_activation import (PatchMeanGeluFunction,
                                                PatchPartition,
                                                tagged_partition)
from ..patching import swap_class

__all__ = ['make_patch_mean_gelu', 'is_patch_mean_gelu',
           'patch_mean_partition']


class _PatchMeanGELU:
    """``nn.GELU`` keeping ``mean_P f'(x)`` on its partition.

    After a call, ``_gf_patch_mean_call`` is the input's shape when the rule
    ran, None when the plain GELU did (for the accounting).
    """

    _gf_patch_mean_partition: Optional[PatchPartition] = None
    _gf_patch_mean_call = None

    def forward(self, x: Tensor) -> Tensor:
        partition = self._gf_patch_mean_partition
        if (partition is None or not torch.is_grad_enabled()
                or not x.requires_grad or tagged_partition(x) != partition):
            self._gf_patch_mean_call = None
            return super().forward(x)
        self._gf_patch_mean_call = tuple(x.shape)
        return PatchMeanGeluFunction.apply(x, self.approximate, partition)


#: The owner of the lean region's class swaps (:mod:`.lean` and these
#: GELUs): :func:`~.lean.make_plain` undoes both.
LEAN_OWNER = 'lean'


def is_patch_mean_gelu(module: nn.Module) -> bool:
    """Whether :func:`make_patch_mean_gelu` swapped ``module``."""
    return isinstance(module, _PatchMeanGELU)


def patch_mean_partition(module: nn.Module) -> Optional[PatchPartition]:
    """The partition a patch-mean GELU relies on (None: not one)."""
    return module._gf_patch_mean_partition if is_patch_mean_gelu(
        module) else None


def make_patch_mean_gelu(module: nn.Module,
                         partition: PatchPartition) -> None:
    """Make ``module`` (an ``nn.GELU``, plain or already swapped) keep the
    patch means of its derivative on ``partition``.

    Raises:
        TypeError: ``module`` is not an ``nn.GELU`` with torch's forward.
    """
    if not is_patch_mean_gelu(module):
        cls = type(module)
        if not issubclass(cls, nn.GELU) or cls.forward is not nn.GELU.forward:
            raise TypeError(f'{cls.__name__} is not an nn.GELU with torch\'s '
                            'forward')
        swap_class(module, _PatchMeanGELU, LEAN_OWNER,
                   f'PatchMean{cls.__name__}')
    module._gf_patch_mean_partition = partition
    module._gf_patch_mean_call = None
