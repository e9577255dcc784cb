"""ValMetricsRecorderHook: every validation result, one JSON line each."""
import json
import os
import os.path as osp
from typing import Dict, List, Optional

from mmengine.dist import master_only
from mmengine.hooks import Hook
from mmseg.registry import HOOKS

__all__ = ['ValMetricsRecorderHook', 'read_val_metrics', 'VAL_METRICS_FILE']

VAL_METRICS_FILE = 'val_metrics.jsonl'


@HOOKS.register_module()
class ValMetricsRecorderHook(Hook):
    """Append ``{"iter": i, "mIoU": ..., "mAcc": ..., "aAcc": ...}`` to
    ``<work_dir>/val_metrics.jsonl`` after every validation.

    The file survives an interrupted run; a resumed run appends to it, and
    :func:`read_val_metrics` keeps the last record per iteration.
    """

    priority = 'LOW'

    @master_only
    def after_val_epoch(self, runner,
                        metrics: Optional[Dict[str, float]] = None) -> None:
        if not metrics:
            return
        record = dict(iter=int(runner.iter))
        record.update({k: float(v) for k, v in metrics.items()})
        os.makedirs(runner.work_dir, exist_ok=True)
        with open(osp.join(runner.work_dir, VAL_METRICS_FILE), 'a') as f:
            f.write(json.dumps(record) + '\n')


def read_val_metrics(work_dir: str) -> List[Dict[str, float]]:
    """The validation records of a run, one per iteration, sorted."""
    path = osp.join(work_dir, VAL_METRICS_FILE)
    if not osp.isfile(path):
        return []
    by_iter: Dict[int, Dict[str, float]] = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                rec = json.loads(line)
                by_iter[int(rec['iter'])] = rec
    return [by_iter[i] for i in sorted(by_iter)]
