"""The CPU demo behind ``make demo``: finetune PSPNet-R18 with gradient
filtering on a small synthetic VOC12Aug and show that mIoU rises.

Writes the data if needed, saves the initialised model, evaluates it,
finetunes from it and evaluates the result (:mod:`mmseg_gf.demo`), then
prints a before/after table; exit status 1 if mIoU did not rise.

Example::

    python tools/demo.py                      # what `make demo` runs
    python tools/demo.py --cfg-options train_cfg.max_iters=100
"""
import argparse
import os.path as osp
import sys
import time
from typing import List, Optional

from mmengine.config import DictAction

import mmseg_gf  # noqa: F401  (registers the plugin's modules and hooks)
from mmseg_gf.accounting.format import format_table
from mmseg_gf.demo import ensure_data, run_demo

DEFAULT_CONFIG = osp.join(osp.dirname(osp.dirname(osp.abspath(__file__))),
                          'configs', 'demo', 'pspnet_r18_voc_r4_cpu.py')


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description='Before/after finetuning demo on synthetic VOC12Aug')
    parser.add_argument('--config', default=DEFAULT_CONFIG)
    parser.add_argument('--work-dir', default='work_dirs/demo')
    parser.add_argument(
        '--data', default='data/demo',
        help='root of the synthetic VOCdevkit (must match the config\'s '
        'data_root, data/demo/VOCdevkit/VOC2012)')
    parser.add_argument('--num-train', type=int, default=96)
    parser.add_argument('--num-val', type=int, default=24)
    parser.add_argument('--size', type=int, nargs=2, default=(96, 128),
                        metavar=('H', 'W'))
    parser.add_argument(
        '--classes', type=int, nargs='+', default=[1, 2, 3, 4, 5],
        help='VOC object ids in the demo data (the head keeps 21 classes; '
        'mIoU averages over the classes present)')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument(
        '--regenerate', action='store_true',
        help='rewrite the data even if it exists')
    parser.add_argument(
        '--cfg-options', nargs='+', action=DictAction, default={},
        help='overrides (key=value) for the training and the evaluations')
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    ensure_data(args.data, args.num_train, args.num_val, args.size,
                args.seed, args.classes, args.regenerate)
    result = run_demo(args.config, args.work_dir, args.cfg_options)
    before, after = result['before'], result['after']
    print()
    print('PSPNet-R18, gradient filter (config: '
          f'{osp.relpath(args.config)}), synthetic VOC12Aug val')
    print(format_table(
        ('model', 'mIoU', 'mAcc', 'aAcc', 'time'),
        [(name, f'{m["mIoU"]:.2f}', f'{m["mAcc"]:.2f}', f'{m["aAcc"]:.2f}',
          f'{result["seconds"][key]:.0f}s')
         for name, key, m in (('before (init)', 'before', before),
                              ('after finetune', 'after', after))],
        align='lrrrr', style='text', rule=False))
    gain = after['mIoU'] - before['mIoU']
    print(f'mIoU change: {gain:+.2f} points; total {time.time() - t0:.0f}s')
    if gain <= 0:
        print('[demo] FAILED: mIoU did not rise', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
