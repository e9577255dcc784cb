"""Layer selection, surgery, config rewrite, checkpoint checking, the hooks.

Importing this package registers ``GradFilterModel`` (mmseg MODELS), the
hooks of :mod:`.hooks` (``GradFilterHook``, ``CalibrationHook``,
``GradientQualityHook``, ``ValMetricsRecorderHook``, ``ExportWeightsHook``;
mmseg HOOKS),
``CPUAmpOptimWrapper`` (mmseg OPTIM_WRAPPERS) and
``CPUDistributedDataParallel`` (mmengine MODEL_WRAPPERS), and allows the
data types of mmengine checkpoints in ``torch.load(weights_only=True)``
through stand-ins that check them (:mod:`.checkpoint.safe_load`), makes
checkpoint writes on the local disk atomic (temporary file, fsync, rename:
:mod:`.checkpoint.atomic_write`) and installs the ``mmseg_gf`` config scope
(:mod:`.scope`: ``_base_ = 'mmseg_gf::gf/...py'``).
"""
from .cpu_amp import CPUAmpOptimWrapper, enable_amp
from .config import build_grad_filter_model, check_settings, rewrite_config
from .cpu_distributed import CPUDistributedDataParallel  # noqa: F401
from .hooks import (CalibrationHook, GradFilterHook, GradientQualityHook,
                    ValMetricsRecorderHook)
from .layer_trace import LayerRecord, trace_layers
from .selection import (LayerChoice, auto_radius, resolve_radius,
                        select_layers)
from ..models.segmentor import set_frozen_norms_eval
from .checkpoint.atomic_write import install_atomic_checkpoints
from .checkpoint.safe_load import allow_mmengine_checkpoints
from . import scope
from .settings import GradientFilterSettings
from .state import GradientFilterState, get_state
from .surgery import apply_gradient_filter, get_gradient_filter_layers

__all__ = [
    'LayerChoice', 'LayerRecord', 'trace_layers',
    'select_layers', 'auto_radius',
    'resolve_radius', 'apply_gradient_filter', 'set_frozen_norms_eval',
    'get_gradient_filter_layers', 'build_grad_filter_model',
    'check_settings', 'GradientFilterSettings', 'rewrite_config',
    'GradFilterHook',
    'GradientQualityHook', 'CalibrationHook', 'ValMetricsRecorderHook',
    'CPUAmpOptimWrapper', 'enable_amp', 'GradientFilterState', 'get_state'
]

allow_mmengine_checkpoints()
install_atomic_checkpoints()
scope.install()
