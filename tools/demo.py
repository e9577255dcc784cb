"""The CPU demo behind ``make demo``: finetune PSPNet-R18 with gradient
filtering on a small synthetic VOC12Aug and show that mIoU rises.

Steps (each one through the same code path as the CLI tools):

1. write the synthetic VOC12Aug under ``--data`` if it is not there
   (``mmseg_gf.datasets.make_voc_aug``, as tools/make_dataset.py);
2. build the Runner of the demo config (tools/train.py's config handling,
   so the ``gradient_filter`` rewrite is applied), initialise the weights
   and save them as ``WORK_DIR/iter_0.pth``;
3. evaluate ``iter_0.pth`` with ``tools/test.py`` (mIoU *before*);
4. finetune from it with ``tools/train.py --cfg-options load_from=...``;
5. evaluate the last checkpoint with ``tools/test.py`` (mIoU *after*);
6. print a before/after table; exit status 1 if mIoU did not rise.

Example::

    python tools/demo.py                      # what `make demo` runs
    python tools/demo.py --cfg-options train_cfg.max_iters=100
"""
import argparse
import json
import os
import os.path as osp
import subprocess
import sys
import time
from typing import Dict, List, Optional

TOOLS = osp.dirname(osp.abspath(__file__))
REPO = osp.dirname(TOOLS)
DEFAULT_CONFIG = osp.join(REPO, 'configs', 'demo', 'pspnet_r18_voc_r4_cpu.py')


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
        '--cfg-options', nargs='+', default=[],
        help='passed on to tools/train.py and tools/test.py')
    return parser.parse_args(argv)


def ensure_data(args: argparse.Namespace) -> str:
    """Write the synthetic data unless ``--data`` already holds data made
    with the same settings (recorded in ``<data>/demo_data.json``)."""
    from mmseg_gf.datasets import make_voc_aug
    data_root = osp.join(args.data, 'VOCdevkit', 'VOC2012')
    settings = dict(num_train=args.num_train, num_val=args.num_val,
                    size=list(args.size), seed=args.seed,
                    classes=list(args.classes))
    stamp = osp.join(args.data, 'demo_data.json')
    marker = osp.join(data_root, 'ImageSets', 'Segmentation', 'val.txt')
    same = False
    if osp.exists(stamp) and osp.exists(marker):
        with open(stamp) as f:
            same = json.load(f) == settings
    if args.regenerate or not same:
        start = time.time()
        make_voc_aug(args.data, args.num_train, args.num_val,
                     size=tuple(args.size), seed=args.seed,
                     classes=args.classes)
        with open(stamp, 'w') as f:
            json.dump(settings, f)
        print(f'[demo] synthetic VOC12Aug written to {data_root} '
              f'({args.num_train} train + {args.num_train} aug / '
              f'{args.num_val} val, {time.time() - start:.1f}s)')
    else:
        print(f'[demo] using existing data in {data_root}')
    return data_root


def save_initial_checkpoint(config: str, work_dir: str,
                            cfg_options: List[str]) -> str:
    """Build the demo Runner as tools/train.py does, initialise the model
    and save its weights (the model 'before' finetuning)."""
    sys.path.insert(0, TOOLS)
    import train as train_tool
    from mmengine.runner.checkpoint import (get_state_dict, save_checkpoint,
                                            weights_to_cpu)
    argv = [config, '--work-dir', osp.join(work_dir, 'init')]
    if cfg_options:
        argv += ['--cfg-options'] + cfg_options
    runner = train_tool.build_runner(
        train_tool.build_config(train_tool.parse_args(argv)))
    runner.model.init_weights()
    path = osp.join(work_dir, 'iter_0.pth')
    save_checkpoint(
        dict(
            meta=dict(iter=0, note='initial weights of the demo model'),
            state_dict=weights_to_cpu(get_state_dict(runner.model))), path)
    return path


def run_tool(name: str, argv: List[str]) -> None:
    cmd = [sys.executable, osp.join(TOOLS, name)] + argv
    print('[demo] $ ' + ' '.join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def evaluate(config: str, checkpoint: str, work_dir: str,
             cfg_options: List[str]) -> Dict[str, float]:
    argv = [config, checkpoint, '--work-dir', work_dir]
    if cfg_options:
        argv += ['--cfg-options'] + cfg_options
    run_tool('test.py', argv)
    with open(osp.join(work_dir, 'metrics.json')) as f:
        return json.load(f)


def last_checkpoint(work_dir: str) -> str:
    with open(osp.join(work_dir, 'last_checkpoint')) as f:
        return f.read().strip()


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    ensure_data(args)
    os.makedirs(args.work_dir, exist_ok=True)
    opts = list(args.cfg_options)

    t = time.time()
    init_ckpt = save_initial_checkpoint(args.config, args.work_dir, opts)
    before = evaluate(args.config, init_ckpt,
                      osp.join(args.work_dir, 'before'), opts)
    t_before = time.time() - t

    t = time.time()
    train_dir = osp.join(args.work_dir, 'finetune')
    run_tool('train.py', [args.config, '--work-dir', train_dir,
                          '--cfg-options', f'load_from={init_ckpt}'] + opts)
    t_train = time.time() - t

    t = time.time()
    after = evaluate(args.config, last_checkpoint(train_dir),
                     osp.join(args.work_dir, 'after'), opts)
    t_after = time.time() - t

    rows = [('before (init)', before, t_before),
            ('after finetune', after, t_train + t_after)]
    print()
    print('PSPNet-R18, gradient filter (config: '
          f'{osp.relpath(args.config)}), synthetic VOC12Aug val')
    print(f'{"model":<16}{"mIoU":>8}{"mAcc":>8}{"aAcc":>8}{"time":>9}')
    for name, m, sec in rows:
        print(f'{name:<16}{m["mIoU"]:>8.2f}{m["mAcc"]:>8.2f}'
              f'{m["aAcc"]:>8.2f}{sec:>8.0f}s')
    gain = after['mIoU'] - before['mIoU']
    print(f'mIoU change: {gain:+.2f} points; total {time.time() - t0:.0f}s')
    if gain <= 0:
        print('[demo] FAILED: mIoU did not rise', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
