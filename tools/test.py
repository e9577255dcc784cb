"""Test (evaluate) a segmentor checkpoint: mmseg 1.x's ``tools/test.py`` CLI.

Checkpoints written by tools/train.py hold plain mmseg keys, so the model is
built from the config as is (gradient filtering only changes backward); the
plugin is still imported so configs that name its modules build. The run
itself is :func:`mmseg_gf.engine.entrypoints.evaluate`.

Prints the metrics (aAcc / mIoU / mAcc) and, with ``--work-dir``, also writes
them to ``<work-dir>/metrics.json``. ``--out DIR`` saves the predicted label
maps as PNGs in DIR (mmseg's IoUMetric ``output_dir``).

Example::

    python tools/test.py configs/gf/pspnet_r18_voc_r4.py \
        work_dirs/psp_r18_r4/iter_20000.pth --work-dir work_dirs/eval
"""
import argparse
import os.path as osp
import sys
from typing import Dict, List, Optional

import mmseg_gf  # noqa: F401  (registers the plugin's modules and hooks)
from mmseg_gf.engine.tool_args import add_common_args, apply_common_args
from mmseg_gf.engine.entrypoints import evaluate, format_metrics


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description='MMSeg test (and eval) a model')
    parser.add_argument('config', help='test config file path')
    parser.add_argument('checkpoint', help='checkpoint file')
    parser.add_argument(
        '--work-dir',
        help='directory for logs; the metrics are dumped there as '
        'metrics.json')
    parser.add_argument(
        '--out',
        type=str,
        help='the directory to save output predictions for offline '
        'evaluation')
    parser.add_argument(
        '--show', action='store_true', help='show prediction results')
    parser.add_argument(
        '--show-dir',
        help='directory where painted images will be saved '
        '(inside work_dir/timestamp/)')
    parser.add_argument(
        '--wait-time', type=float, default=2, help='the interval of show (s)')
    add_common_args(parser)
    parser.add_argument(
        '--tta', action='store_true', help='test time augmentation')
    args = parser.parse_args(argv)
    for name in ('config', 'checkpoint'):
        path = getattr(args, name)
        if '://' not in path and not osp.isfile(path):
            parser.error(f'{name}: file {path!r} does not exist')
    apply_common_args(args)
    return args


def main(argv: Optional[List[str]] = None) -> Dict[str, float]:
    args = parse_args(argv)
    metrics = evaluate(args.config, args.checkpoint, work_dir=args.work_dir,
                       cfg_options=args.cfg_options, launcher=args.launcher,
                       out=args.out, show=args.show, show_dir=args.show_dir,
                       wait_time=args.wait_time, tta=args.tta)
    print('Test metrics (%):')
    print(format_metrics(metrics))
    return metrics


if __name__ == '__main__':
    main(sys.argv[1:])
