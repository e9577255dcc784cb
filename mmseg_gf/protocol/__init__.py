"""The paper's segmentation protocol as one command (tools/run_protocol.py).

source model (mmseg checkpoint, or trained here offline) -> calibration ->
finetune with each strategy and seed -> results.md / results.csv /
results.png in the layout of Tables 3 and 9.

* :mod:`.experiments`: the models, datasets, transfers and strategies.
* :mod:`.run_config`: how a run's config is composed from the
  ``configs/_base_`` pieces.
* :mod:`.stages`: planning, running (resumable), progress.
* :mod:`.flops`: #Layers and backward GFLOPs of a strategy (through the
  shared cost model :mod:`mmseg_gf.ops.conv.cost`).
* :mod:`.report`: the tables and the plot.
* :mod:`.paper_table3`: our backward GFLOPs next to the paper's Table 3.
* ``ValMetricsRecorderHook`` (:mod:`mmseg_gf.engine.hooks`) appends every
  validation result to ``<work_dir>/val_metrics.jsonl``.
"""
from .experiments import (PROTOCOL_DATASETS, PROTOCOL_MODELS, STRATEGIES,
                          TRANSFERS, strategy_names)
from .run_config import compose_config

__all__ = [
    'PROTOCOL_DATASETS', 'PROTOCOL_MODELS', 'STRATEGIES', 'TRANSFERS',
    'compose_config', 'strategy_names'
]
