"""The import path that the pipeline's run configs name in ``custom_imports``.

``ValMetricsRecorderHook`` lives in :mod:`mmseg_gf.engine.hooks`. Every
composed run config lists ``mmseg_gf.pipeline.hooks`` in ``custom_imports``
and a run's fingerprint hashes its config, so this module stays: the
fingerprints of existing runs, and their dumped ``config.py``, stay valid.
"""
from ..engine.hooks.val_metrics_recorder_hook import (  # noqa: F401
    VAL_METRICS_FILE, ValMetricsRecorderHook, read_val_metrics)
