"""Train (finetune) a segmentor with gradient filtering.

mmseg 1.x's ``tools/train.py`` CLI, plus two plugin steps: ``import mmseg_gf``
(registers GFConv2d, GradFilterHook, ...) and ``rewrite_config(cfg)``, which
turns a top-level ``gradient_filter = dict(num_layers, radius, mode)`` into
the model rewrite (last N convs filtered, the rest frozen).

Example::

    python tools/train.py configs/gf/pspnet_r18_voc_r4.py \
        --work-dir work_dirs/psp_r18_r4 \
        --cfg-options load_from=checkpoints/pspnet_r18_cityscapes.pth
    # distributed:
    python -m torch.distributed.run --nproc_per_node=4 tools/train.py \
        CONFIG --launcher pytorch
"""
import argparse
import logging
import os
import os.path as osp
import sys
from typing import List, Optional

from mmengine.config import Config, DictAction
from mmengine.logging import print_log
from mmengine.runner import Runner

import mmseg_gf  # noqa: F401  (registers the plugin's modules and hooks)

# mmengine 0.10.7 calls torch.load() without weights_only; torch >= 2.6
# defaults to weights_only=True and refuses mmengine's own checkpoints (their
# message_hub holds HistoryBuffer / numpy objects). The checkpoint comes from
# the command line or the config, which is itself executed Python, so it is
# trusted as much as the config: restore the pre-2.6 behaviour unless the user
# chose otherwise.
os.environ.setdefault('TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD', '1')
from mmseg_gf.engine import rewrite_config


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description='Train a segmentor (with gradient filtering)')
    parser.add_argument('config', help='train config file path')
    parser.add_argument('--work-dir', help='the dir to save logs and models')
    parser.add_argument(
        '--resume',
        action='store_true',
        default=False,
        help='resume from the latest checkpoint in the work_dir automatically')
    parser.add_argument(
        '--amp',
        action='store_true',
        default=False,
        help='enable automatic-mixed-precision training')
    parser.add_argument(
        '--cfg-options',
        nargs='+',
        action=DictAction,
        help='override some settings in the used config, the key-value pair '
        'in xxx=yyy format will be merged into config file. If the value to '
        'be overwritten is a list, it should be like key="[a,b]" or key=a,b; '
        'nested lists/tuples like key="[(a,b),(c,d)]". No white space.')
    parser.add_argument(
        '--launcher',
        choices=['none', 'pytorch', 'slurm', 'mpi'],
        default='none',
        help='job launcher')
    # torch.distributed.launch passes --local-rank (torch >= 2.0) or
    # --local_rank (older).
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    args = parser.parse_args(argv)
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(args.local_rank)
    return args


def build_config(args: argparse.Namespace) -> Config:
    """Load the config and apply the CLI overrides and the plugin rewrite."""
    cfg = Config.fromfile(args.config)
    cfg.launcher = args.launcher
    if args.cfg_options is not None:
        cfg.merge_from_dict(args.cfg_options)

    # work_dir: CLI > config > ./work_dirs/<config name>
    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get('work_dir', None) is None:
        cfg.work_dir = osp.join('./work_dirs',
                                osp.splitext(osp.basename(args.config))[0])

    if args.amp:
        if cfg.optim_wrapper.type == 'AmpOptimWrapper':
            print_log(
                'AMP training is already enabled in your config.',
                logger='current',
                level=logging.WARNING)
        else:
            assert cfg.optim_wrapper.type == 'OptimWrapper', (
                '`--amp` is only supported when the optimizer wrapper type is '
                f'`OptimWrapper` but got {cfg.optim_wrapper.type}.')
            cfg.optim_wrapper.type = 'AmpOptimWrapper'
            cfg.optim_wrapper.loss_scale = 'dynamic'

    cfg.resume = args.resume

    # `gradient_filter = dict(...)` -> GradFilterModel + GradFilterHook;
    # a config without it is returned unchanged.
    return rewrite_config(cfg)


def build_runner(cfg: Config) -> Runner:
    if 'runner_type' in cfg:
        from mmseg.registry import RUNNERS
        return RUNNERS.build(cfg)
    return Runner.from_cfg(cfg)


def main(argv: Optional[List[str]] = None) -> Runner:
    args = parse_args(argv)
    runner = build_runner(build_config(args))
    runner.train()
    return runner


if __name__ == '__main__':
    main(sys.argv[1:])
