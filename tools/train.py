"""Train (finetune) a segmentor with gradient filtering.

mmseg 1.x's ``tools/train.py`` CLI, plus two plugin steps: ``import mmseg_gf``
(registers GFConv2d, GradFilterHook, ...) and ``rewrite_config(cfg)``, which
turns a top-level ``gradient_filter = dict(num_layers, radius, mode)`` into
the model rewrite (last N convs filtered, the rest frozen).

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
import logging
import os.path as osp
import sys
from typing import List, Optional

from mmengine.config import Config
from mmengine.logging import print_log
from mmengine.runner import Runner, find_latest_checkpoint

import mmseg_gf  # noqa: F401  (registers the plugin's modules and hooks)
from mmseg_gf.engine.cli import (add_common_args, load_config,
                                 trust_mmengine_checkpoints)
from mmseg_gf.engine.cpu_amp import enable_amp
from mmseg_gf.engine import rewrite_config
from mmseg_gf.engine.cpu_distributed import (init_cpu_process_group,
                                             prepare_cpu_distributed)

trust_mmengine_checkpoints()  # before any checkpoint is read


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
    return args


def resolve_resume(cfg: Config, resume: bool) -> Config:
    """``--resume``: continue from the latest checkpoint in ``work_dir``.

    mmengine reads ``resume=True`` together with a ``load_from`` as "resume
    from load_from". A finetuning config's ``load_from`` is the pretrained
    model, so that would restart from it, or, with its ``meta`` iteration
    count (e.g. 80k of the original training), end at once. Here the latest
    checkpoint of this run wins; without one the run starts from
    ``load_from`` as a fresh run would.
    """
    cfg.resume = False
    if not resume:
        return cfg
    latest = find_latest_checkpoint(cfg.work_dir)
    if latest is not None:
        cfg.load_from = latest
        cfg.resume = True
    else:
        print_log(
            f'--resume: no checkpoint in {cfg.work_dir} yet; starting from '
            f'load_from={cfg.get("load_from")!r}', logger='current',
            level=logging.WARNING)
    return cfg


def build_config(args: argparse.Namespace) -> Config:
    """Load the config and apply the CLI overrides and the plugin rewrite."""
    cfg = load_config(args)

    if args.amp:
        enable_amp(cfg)

    resolve_resume(cfg, args.resume)
    # Distributed without CUDA: gloo and a CPU DDP wrapper.
    prepare_cpu_distributed(cfg)

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
    cfg = build_config(args)
    # mmengine's init_dist('pytorch') needs CUDA; create the gloo group
    # first on a CPU-only machine (the Runner then reuses it).
    init_cpu_process_group(cfg)
    runner = build_runner(cfg)
    runner.train()
    return runner


if __name__ == '__main__':
    main(sys.argv[1:])
