"""mmseg_gf: gradient filtering (Yang, Li, Marculescu, CVPR 2023) for
MMSegmentation.

Importing the package registers everything with mmseg / mmengine, so an
existing config only needs ``custom_imports = dict(imports=['mmseg_gf'])``.
Without mmseg installed, the pure-PyTorch operator in ``mmseg_gf.ops`` still
imports; a broken mmseg installation still fails loudly. Where the compiled
CPU kernels are not built, the import warns once
(``ops.backend.availability.KernelsMissingWarning``) and the PyTorch path runs.
"""
from importlib.util import find_spec

from .models import GFConv2d
from .ops.bit_mask import masks as bit_mask
from .ops.backend import availability
from .ops.resized_loss import loss as resized_loss  # noqa: F401 (loaders)
from .ops import check_radius, gradient_filtered_conv2d

__version__ = '0.1.0'
__all__ = ['GFConv2d', 'check_radius', 'gradient_filtered_conv2d']

if find_spec('mmseg') is not None:
    from . import engine  # noqa: F401  (registers the hook and the builder)

# Every loader of the compiled kernels has run: one warning if any is missing.
availability.warn_if_kernels_missing()
