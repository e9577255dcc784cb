"""Test (evaluate) a segmentor checkpoint: mmseg 1.x's ``tools/test.py`` CLI.

Checkpoints written by tools/train.py hold plain mmseg keys, so the model is
built from the config as is (gradient filtering only changes backward); the
plugin is still imported so configs that name its modules build.

Prints the metrics (aAcc / mIoU / mAcc) and, with ``--work-dir``, also writes
them to ``<work-dir>/metrics.json``. ``--out DIR`` saves the predicted label
maps as PNGs in DIR (mmseg's IoUMetric ``output_dir``).

Example::

    python tools/test.py configs/gf/pspnet_r18_voc_r4.py \
        work_dirs/psp_r18_r4/iter_20000.pth --work-dir work_dirs/eval
"""
import argparse
import json
import os
import os.path as osp
import sys
from typing import Dict, List, Optional

from mmengine.config import Config
from mmengine.runner import Runner

import mmseg_gf  # noqa: F401  (registers the plugin's modules and hooks)
from mmseg_gf.engine.checkpoint import check_checkpoint_matches
from mmseg_gf.engine.cli import (add_common_args, load_config,
                                 trust_mmengine_checkpoints)
from mmseg_gf.engine.cpu_distributed import (init_cpu_process_group,
                                             prepare_cpu_distributed)

trust_mmengine_checkpoints()  # before any checkpoint is read


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
    return args


def trigger_visualization_hook(cfg: Config,
                               args: argparse.Namespace) -> Config:
    default_hooks = cfg.default_hooks
    if 'visualization' not in default_hooks:
        raise RuntimeError(
            'VisualizationHook must be included in default_hooks, e.g. '
            '"visualization=dict(type=\'SegVisualizationHook\')"')
    hook = default_hooks['visualization']
    hook['draw'] = True
    if args.show:
        hook['show'] = True
        hook['wait_time'] = args.wait_time
    if args.show_dir:
        cfg.visualizer['save_dir'] = args.show_dir
    return cfg


def build_config(args: argparse.Namespace) -> Config:
    cfg = load_config(args)
    cfg.load_from = args.checkpoint
    cfg.resume = False
    if args.show or args.show_dir:
        cfg = trigger_visualization_hook(cfg, args)
    if args.tta:
        cfg.test_dataloader.dataset.pipeline = cfg.tta_pipeline
        cfg.tta_model.module = cfg.model
        cfg.model = cfg.tta_model
    if args.out is not None:
        cfg.test_evaluator['output_dir'] = args.out
        cfg.test_evaluator['keep_results'] = True
    return prepare_cpu_distributed(cfg)


def format_metrics(metrics: Dict[str, float]) -> str:
    keys = [k for k in ('aAcc', 'mIoU', 'mAcc') if k in metrics]
    keys += sorted(k for k in metrics if k not in keys)
    return '\n'.join(f'{k:>6s}: {metrics[k]:.2f}' for k in keys)


def run_test(cfg: Config) -> Dict[str, float]:
    """Build a Runner from ``cfg`` and return its test metrics.

    The checkpoint must match the model exactly (mmengine would load it with
    ``strict=False`` and evaluate whatever weights did not load): a
    mismatch raises ValueError before anything is evaluated.
    """
    init_cpu_process_group(cfg)
    runner = Runner.from_cfg(cfg)
    model = getattr(runner.model, 'module', runner.model)
    check_checkpoint_matches(model, cfg.load_from, setting='checkpoint',
                             allowed=None)
    metrics = runner.test()
    metrics = {k: float(v) for k, v in metrics.items()}
    if runner.rank == 0:
        os.makedirs(cfg.work_dir, exist_ok=True)
        with open(osp.join(cfg.work_dir, 'metrics.json'), 'w') as f:
            json.dump(metrics, f, indent=2)
    return metrics


def main(argv: Optional[List[str]] = None) -> Dict[str, float]:
    args = parse_args(argv)
    metrics = run_test(build_config(args))
    print('Test metrics (%):')
    print(format_metrics(metrics))
    return metrics


if __name__ == '__main__':
    main(sys.argv[1:])
