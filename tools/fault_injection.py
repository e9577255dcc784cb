"""Kill a training run with SIGKILL at random points, inside checkpoint
writes included, resume it until its schedule completes, and compare its
final weights with an uninterrupted run's, bit for bit.

The run is the CPU demo's setting (configs/demo/pspnet_r18_voc_r4_cpu.py)
shrunk to a few iterations on small crops, on a small synthetic VOC12Aug
written under ``--data`` when missing; see
:mod:`mmseg_gf.analysis.fault_injection` for the kills and the children.

Examples::

    python tools/fault_injection.py --kills 20 --in-write 5 \
        --work-dir work_dirs/fault_injection \
        --out docs/benchmarks/fault_injection_cpu.json
    python tools/fault_injection.py --kills 4 --pipeline demo
"""
import argparse
import os.path as osp
from typing import Any, Dict, List, Optional

import mmseg_gf  # noqa: F401  (registers the plugin, atomic writes)
from mmseg_gf.analysis.fault_injection import (PIPELINES, FaultSetting,
                                               run_fault_injection)
from mmseg_gf.analysis.fault_report import fault_markdown
from mmseg_gf.analysis.hardware import cpu_model
from mmseg_gf.demo import ensure_data
from mmseg_gf.engine.tool_args import command_line, write_report

DEMO_CONFIG = osp.join(osp.dirname(osp.dirname(osp.abspath(__file__))),
                       'configs', 'demo', 'pspnet_r18_voc_r4_cpu.py')


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description='SIGKILL a training run at random points (inside '
        'checkpoint writes too), resume it, compare its final weights with '
        'an uninterrupted run\'s')
    parser.add_argument('--config', default=DEMO_CONFIG,
                        help='the demo config the children shrink')
    parser.add_argument('--work-dir', default='work_dirs/fault_injection')
    parser.add_argument('--data', default='data/fault_injection',
                        help='where the small synthetic VOC12Aug goes')
    parser.add_argument('--kills', type=int, default=20)
    parser.add_argument('--in-write', type=int, default=5,
                        help='how many of the kills land inside a '
                        'checkpoint or last_checkpoint write')
    parser.add_argument('--kills-per-episode', type=int, default=4,
                        help='kills before a schedule is resumed to its end')
    parser.add_argument('--max-iters', type=int, default=12)
    parser.add_argument('--interval', type=int, default=3,
                        help='a checkpoint every this many iterations')
    parser.add_argument('--crop', type=int, default=32)
    parser.add_argument('--batch', type=int, default=2)
    parser.add_argument('--max-keep-ckpts', type=int, default=2)
    parser.add_argument('--pipeline', choices=PIPELINES, default='fixed',
                        help='fixed: resize, no dropout; demo: the demo\'s '
                        'random augmentations and dropout (both resume bit '
                        'for bit)')
    parser.add_argument('--seed', type=int, default=0,
                        help='seed of the kill points')
    parser.add_argument('--out', help='write the result to this json file '
                        '(and the table to the same name with .md)')
    args = parser.parse_args(argv)
    if not osp.isfile(args.config):
        parser.error(f'--config: file {args.config!r} does not exist')
    if args.kills < 1 or not 0 <= args.in_write <= args.kills:
        parser.error('need --kills >= 1 and 0 <= --in-write <= --kills')
    return args


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    data_root = ensure_data(args.data, num_train=8, num_val=2,
                            size=(args.crop * 3 // 2, args.crop * 2))
    setting = FaultSetting(
        demo_config=args.config, data_root=osp.abspath(data_root),
        max_iters=args.max_iters, interval=args.interval, crop=args.crop,
        batch_size=args.batch, max_keep_ckpts=args.max_keep_ckpts,
        pipeline=args.pipeline)
    try:
        setting.check()
    except ValueError as err:
        raise SystemExit(f'fault_injection: {err}')
    result = run_fault_injection(
        setting, args.work_dir, kills=args.kills, in_write=args.in_write,
        kills_per_episode=args.kills_per_episode, seed=args.seed)
    command = command_line('fault_injection', argv)
    text = fault_markdown(result, command, cpu_model())
    print(text)
    if args.out:
        write_report(args.out, dict(result, command=command,
                                    cpu=cpu_model()), text)
    return result


if __name__ == '__main__':
    main()
