"""Layer selection, surgery, config rewrite and GradFilterHook.

Importing this package registers ``GradFilterModel`` (mmseg MODELS),
``GradFilterHook`` and ``GradientQualityHook`` (mmseg HOOKS) and
``CPUAmpOptimWrapper`` (mmseg OPTIM_WRAPPERS).
"""
from .calibration import CalibrationHook  # noqa: F401 (registers it)
from .cpu_amp import CPUAmpOptimWrapper, enable_amp
from .config import build_grad_filter_model, check_settings, rewrite_config
from .cpu_distributed import CPUDistributedDataParallel  # noqa: F401
from .hooks import GradFilterHook, format_cost_table
from .quality_hook import GradientQualityHook
from .selection import (LayerChoice, auto_radius, resolve_radius,
                        select_layers, trace_convs)
from .surgery import (apply_gradient_filter, get_gradient_filter_layers,
                      set_frozen_norms_eval)

__all__ = [
    'LayerChoice', 'trace_convs', 'select_layers', 'auto_radius',
    'resolve_radius', 'apply_gradient_filter', 'set_frozen_norms_eval',
    'get_gradient_filter_layers', 'build_grad_filter_model',
    'check_settings', 'rewrite_config', 'GradFilterHook', 'format_cost_table',
    'GradientQualityHook', 'CPUAmpOptimWrapper', 'enable_amp'
]
