"""Pure-PyTorch gradient-filter operators (no mmseg / mmcv dependency)."""
from .gradient_filter import (AxisGeometry, GradientFilterConv2dFunction,
                              check_radius, gradient_filtered_conv2d)

__all__ = [
    'AxisGeometry', 'GradientFilterConv2dFunction', 'check_radius',
    'gradient_filtered_conv2d'
]
