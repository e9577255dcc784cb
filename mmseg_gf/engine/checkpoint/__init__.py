"""Checkpoint files: loading them safely, checking them against a model,
writing them atomically, exporting plain-mmseg weights.

Lowest first: :mod:`.pickle_scan`, :mod:`.data`, :mod:`.load_bounds`,
:mod:`.safe_load`, :mod:`.atomic_write`, :mod:`.resume`,
:mod:`.matching`, :mod:`.weights_export`.
"""
from .atomic_write import (install_atomic_checkpoints,
                           uninstall_atomic_checkpoints)
from .matching import CLASSIFIER_KEYS, check_checkpoint_matches, \
    load_from_report
from .safe_load import allow_mmengine_checkpoints, load_checkpoint_file
from .resume import NoResumableCheckpoint, find_resumable_checkpoint
from .weights_export import export_weights

__all__ = ['CLASSIFIER_KEYS', 'check_checkpoint_matches', 'load_from_report',
           'allow_mmengine_checkpoints', 'load_checkpoint_file',
           'export_weights', 'install_atomic_checkpoints',
           'uninstall_atomic_checkpoints', 'find_resumable_checkpoint',
           'NoResumableCheckpoint']
