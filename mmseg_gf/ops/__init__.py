"""Gradient-filter operators (no mmseg / mmcv dependency): pure PyTorch,
plus optional compiled CPU kernels (``cpu`` modules) and Triton GPU kernels
(``gpu`` modules), one folder per operator; ``backend`` holds what they
share."""
from .conv.function import (AxisGeometry, GradientFilterConv2dFunction,
                            as_pair, check_radius, gradient_filtered_conv2d)
from .linear.function import (GradientFilterLinearFunction,
                              gradient_filtered_linear)
from .linear.token_grid import TokenGrid
from .patch_grid import MAX_RADIUS
# every operator's implementations registered with the dispatcher
from . import (bit_mask, conv_block, frozen_norm, resize,  # noqa: F401,E402
               resized_loss)

__all__ = [
    'AxisGeometry', 'GradientFilterConv2dFunction', 'as_pair', 'check_radius',
    'gradient_filtered_conv2d', 'GradientFilterLinearFunction', 'TokenGrid',
    'gradient_filtered_linear', 'MAX_RADIUS'
]
