"""The plugin's mmengine hooks, one per module; importing registers them in
mmseg's ``HOOKS``."""
from .calibration_hook import CalibrationHook
from .export_weights_hook import ExportWeightsHook
from .grad_filter_hook import GradFilterHook
from .gradient_quality_hook import GradientQualityHook
from .val_metrics_recorder_hook import (VAL_METRICS_FILE,
                                        ValMetricsRecorderHook,
                                        read_val_metrics)

__all__ = [
    'CalibrationHook', 'ExportWeightsHook', 'GradFilterHook',
    'GradientQualityHook', 'ValMetricsRecorderHook', 'read_val_metrics',
    'VAL_METRICS_FILE'
]
