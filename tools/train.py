"""Train (finetune) a segmentor with gradient filtering.

mmseg 1.x's ``tools/train.py`` CLI, plus two plugin steps: ``import mmseg_gf``
(registers GFConv2d, GradFilterHook, ...) and ``rewrite_config(cfg)``, which
turns a top-level ``gradient_filter = dict(num_layers, radius, mode)`` into
the model rewrite (last N convs filtered, the rest frozen). The run itself
is :func:`mmseg_gf.engine.entrypoints.train`.

Example::

    python tools/train.py configs/gf/pspnet_r18_voc_r4.py \
        --work-dir work_dirs/psp_r18_r4 \
        --cfg-options load_from=checkpoints/pspnet_r18_cityscapes.pth
    # distributed (GPUs: nccl; a CPU-only machine: gloo, chosen here):
    python -m torch.distributed.run --nproc_per_node=4 tools/train.py \
        CONFIG --launcher pytorch
    # continue an interrupted run from the latest checkpoint in work_dir:
    python tools/train.py CONFIG --work-dir work_dirs/psp_r18_r4 --resume
"""
import argparse
import os.path as osp
import sys
from typing import List, Optional

from mmengine.runner import Runner

import mmseg_gf  # noqa: F401  (registers the plugin's modules and hooks)
from mmseg_gf.engine.tool_args import add_common_args, apply_common_args
from mmseg_gf.engine.entrypoints import train


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description='Train a segmentor (with gradient filtering)')
    parser.add_argument('config', help='train config file path')
    parser.add_argument('--work-dir', help='the dir to save logs and models')
    parser.add_argument(
        '--resume',
        action='store_true',
        default=False,
        help='resume from the latest checkpoint in the work_dir '
        'automatically (model, optimizer, scheduler, iteration); with no '
        'checkpoint there yet, start from load_from as usual')
    parser.add_argument(
        '--amp',
        action='store_true',
        default=False,
        help='enable automatic-mixed-precision training (bfloat16 '
        'autocast on a machine without CUDA)')
    add_common_args(parser)
    args = parser.parse_args(argv)
    if not osp.isfile(args.config):
        parser.error(f'config: file {args.config!r} does not exist')
    apply_common_args(args)
    return args


def main(argv: Optional[List[str]] = None) -> Runner:
    args = parse_args(argv)
    return train(args.config, work_dir=args.work_dir,
                 cfg_options=args.cfg_options, resume=args.resume,
                 amp=args.amp, launcher=args.launcher)


if __name__ == '__main__':
    main(sys.argv[1:])
