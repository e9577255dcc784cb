"""Checkpoint files: loading them safely, checking them against a model,
exporting plain-mmseg weights.

A checkpoint is data from outside, read before training; its modules sit
together here, lowest first:

* :mod:`.pickle_scan`: the names a checkpoint's pickle holds, read without
  unpickling it;
* :mod:`.data`: the checking stand-ins that numpy's and mmengine's types
  resolve to (they check every argument and state before anything is
  built), and the refusal error;
* :mod:`.load_bounds`: the memory a load may take, added up before it;
* :mod:`.safe_load`: ``torch.load(weights_only=True)`` with those
  stand-ins on torch's allow-list, and the explicit trust of a name;
* :mod:`.atomic_write`: checkpoints and ``last_checkpoint`` written
  through a temporary file, fsync and rename, outdated ones deleted after;
* :mod:`.resume`: the newest checkpoint of a work dir that loads;
* :mod:`.matching`: a ``load_from`` checkpoint checked against the model
  it is loaded into (:func:`check_checkpoint_matches`);
* :mod:`.weights_export`: a trained checkpoint written as plain-mmseg
  weights.
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
