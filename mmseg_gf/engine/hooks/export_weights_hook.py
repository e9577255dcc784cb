"""ExportWeightsHook: the run's last checkpoint, also as a weights file that
plain mmseg loads."""
import logging
import os.path as osp
from typing import Optional

from mmengine.dist import master_only
from mmengine.hooks import Hook
from mmengine.logging import print_log
from mmengine.runner import find_latest_checkpoint
from mmseg.registry import HOOKS

from ..checkpoint.weights_export import export_weights

__all__ = ['ExportWeightsHook']


@HOOKS.register_module()
class ExportWeightsHook(Hook):
    """After training, write the last checkpoint's weights and plain meta
    next to it (``iter_N.pth`` -> ``iter_N_weights.pth``), as
    ``tools/export_weights.py`` does.

    A Runner's checkpoint holds mmengine's ``HistoryBuffer``, which
    ``torch.load(weights_only=True)`` (torch >= 2.6) refuses without this
    plugin; the exported file holds tensors and plain data only, so mmseg's
    ``init_model`` and ``tools/test.py`` load it anywhere
    (:mod:`mmseg_gf.engine.checkpoint.weights_export`).

    Args:
        out: the file to write instead (relative paths: in ``work_dir``).
    """

    priority = 'LOWEST'

    def __init__(self, out: Optional[str] = None):
        self.out = out

    @master_only
    def after_run(self, runner) -> None:
        last = find_latest_checkpoint(runner.work_dir)
        if last is None:
            print_log('ExportWeightsHook: no checkpoint in '
                      f'{runner.work_dir!r} to export (the CheckpointHook '
                      'saved none)', logger='current', level=logging.WARNING)
            return
        out = osp.join(runner.work_dir, self.out) if self.out else \
            osp.splitext(last)[0] + '_weights.pth'
        summary = export_weights(last, out)
        print_log(f'ExportWeightsHook: wrote {out} ({summary["keys"]} '
                  'tensors; loads in mmseg without the plugin)',
                  logger='current')
