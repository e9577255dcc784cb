"""mmengine's ``compile=True`` in a Runner run against eager mode.

Trains a config for ``--iters`` iterations eagerly, then compiled (through
``GradFilterHook``: the segmentor's loss), and prints when Dynamo compiled,
against the input shapes, and the steady-state step time of each; see
:mod:`mmseg_gf.analysis.runner_compile`.

Examples::

    # the demo's config (its data: python tools/demo.py writes it)
    python tools/benchmark_runner_compile.py \
        configs/demo/pspnet_r18_voc_r4_cpu.py --iters 50
    # an unchanged zoo config with the hook, offline, at a small crop
    python tools/benchmark_runner_compile.py \
        configs/demo/zoo_deeplabv3plus_hook.py --offline --crop 64 128
"""
import argparse
import ast
from typing import List, Optional

from mmengine.config import Config, DictAction

import mmseg_gf  # noqa: F401  (registers the plugin's modules)
from mmseg_gf.analysis.runner_compile import (compare, format_report,
                                              small_crop)
from mmseg_gf.engine.zoo import make_offline


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('config')
    p.add_argument('--iters', type=int, default=50)
    p.add_argument('--crop', type=int, nargs=2, metavar=('H', 'W'),
                   help="the training crop (pipeline and preprocessor)")
    p.add_argument('--offline', action='store_true',
                   help='SyncBN -> BN, no pretrained checkpoint (zoo)')
    p.add_argument('--compile', default='True',
                   help="the config's compile setting, a Python literal "
                   "(default True; e.g. \"dict(mode='max-autotune')\" "
                   'is not a literal: write {"mode": "max-autotune"})')
    p.add_argument('--work-dir', default='work_dirs/runner_compile')
    p.add_argument('--out', help='append the markdown report to this file')
    p.add_argument('--cfg-options', nargs='+', action=DictAction)
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    cfg = Config.fromfile(args.config)
    if args.cfg_options:
        cfg.merge_from_dict(args.cfg_options)
    if args.offline:
        make_offline(cfg)
    if args.crop:
        small_crop(cfg, args.crop)
    result = compare(cfg, args.iters, args.work_dir,
                     ast.literal_eval(args.compile))
    report = format_report(result, args.config)
    print(report)
    if args.out:
        with open(args.out, 'a') as f:
            f.write(report + '\n\n')


if __name__ == '__main__':
    main()
