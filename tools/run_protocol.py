"""The paper's segmentation protocol for one model and one transfer:
(source model ->) calibrate -> finetune each strategy for each seed ->
results.md / results.csv / runs.csv / results.png (Tables 3 and 9, Fig. 4).

Resumable: run the same command again after an interruption; finished runs
are skipped, the interrupted one resumes from its last checkpoint.

Examples::

    # The paper's Table 3 row block for PSPNet-R18 on real data, starting
    # from mmseg's Cityscapes checkpoint (downloaded by mmengine):
    python tools/run_protocol.py --model pspnet_r18 --transfer cityscapes2voc \
        --source-checkpoint zoo
    # ... from a local checkpoint, selected strategies, one seed:
    python tools/run_protocol.py --model upernet_r18 --transfer ade2voc \
        --source-checkpoint checkpoints/upernet_r18_ade20k.pth \
        --strategies calib vanilla_all gf_last10_r4 gf_ref10 --seeds 233
    # Offline CPU demo on synthetic data, source model trained here:
    python tools/run_protocol.py --model pspnet_r18 --transfer cityscapes2voc \
        --preset cpu
"""
import argparse
import sys
from typing import List, Optional

from mmengine.config import DictAction

from mmseg_gf.protocol import PROTOCOL_MODELS, TRANSFERS, strategy_names
from mmseg_gf.protocol.experiments import PAPER_STRATEGIES
from mmseg_gf.protocol.stages import ProtocolOptions, ProtocolRun

#: --preset cpu: a reduced version that runs on a laptop CPU in minutes.
CPU_PRESET = dict(
    synthetic='data/protocol_synthetic', synthetic_train=48,
    synthetic_val=12, crop=(64, 64), batch_size=4, num_workers=2,
    source_iters=300, calib_iters=100, finetune_iters=200, val_interval=100)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description='Calibrate + finetune one model on one transfer with a '
        'list of strategies and seeds; write the Table 3/9 layout.',
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument('--model', required=True,
                   choices=sorted(PROTOCOL_MODELS))
    p.add_argument('--transfer', required=True, choices=sorted(TRANSFERS))
    p.add_argument(
        '--strategies', nargs='+', default=list(PAPER_STRATEGIES),
        help=f'built-in: {strategy_names()} (gf_ref*/vanilla_ref*: the '
        'reference implementation\'s layer lists, for pspnet_r18 (5, 10), '
        'deeplabv3_r18, fcn_r18, upernet_r18 (10)), or paths to strategy '
        'files')
    p.add_argument('--seeds', nargs='+', type=int, default=[233, 234, 235])
    p.add_argument(
        '--work-dir', dest='out_dir',
        help='output directory (default: work_dirs/protocol/'
        '<model>_<transfer>)')
    p.add_argument(
        '--source-checkpoint',
        help='model trained on the source dataset, a file or URL, or "zoo" '
        'for the mmseg model-zoo checkpoint; without it a source model is '
        'trained here from random init (offline)')
    p.add_argument('--source-root', help='data_root of the source dataset '
                   '(default: the mmseg config\'s, e.g. data/cityscapes/)')
    p.add_argument('--target-root', help='data_root of the target dataset '
                   '(default: e.g. data/VOCdevkit/VOC2012)')
    p.add_argument(
        '--synthetic', metavar='DIR',
        help='write small synthetic source/target datasets under DIR (if '
        'not there yet) and use them; images are resized to their own size '
        'and cropped to --crop (default 64x64)')
    p.add_argument('--synthetic-train', type=int,
                   help='synthetic training images per dataset (default 64)')
    p.add_argument('--synthetic-val', type=int,
                   help='synthetic validation images per dataset (default '
                   '16)')
    p.add_argument('--crop', type=int, nargs=2, metavar=('H', 'W'),
                   help='training crop (default: the dataset config\'s)')
    p.add_argument('--batch-size', type=int,
                   help='train batch size (default 8, the paper\'s)')
    p.add_argument('--num-workers', type=int)
    p.add_argument('--source-iters', type=int,
                   help='source training iterations (default 8000)')
    p.add_argument('--calib-iters', type=int,
                   help='calibration iterations (default 1000; 5000 for '
                   'the MobileNetV2 models)')
    p.add_argument('--finetune-iters', type=int,
                   help='finetuning iterations (default 20000)')
    p.add_argument('--val-interval', type=int,
                   help='finetuning validation (and checkpoint) interval '
                   '(default 2000 of 20000, scaled with --finetune-iters)')
    p.add_argument('--calib-seed', type=int, default=233,
                   help='seed of the source and calibration runs')
    p.add_argument(
        '--preset', choices=['cpu'],
        help='cpu: synthetic data, 64x64 crops, batch 4, 300/100/200 '
        'iterations (source/calibration/finetuning); explicit options win')
    p.add_argument(
        '--isolate', action='store_true',
        help='run each training in a new Python process (all it held in '
        'memory is given back when it ends)')
    p.add_argument('--dry-run', action='store_true',
                   help='print the plan and exit')
    p.add_argument('--report-only', action='store_true',
                   help='write the report from the runs that finished')
    p.add_argument(
        '--cfg-options', nargs='+', action=DictAction, default={},
        help='overrides for every run\'s config (key=value)')
    args = p.parse_args(argv)
    if args.preset == 'cpu':
        for key, value in CPU_PRESET.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
    return args


def options(args: argparse.Namespace) -> ProtocolOptions:
    return ProtocolOptions(
        model=args.model, transfer=args.transfer,
        strategies=list(args.strategies), seeds=list(args.seeds),
        out_dir=args.out_dir, source_checkpoint=args.source_checkpoint,
        source_root=args.source_root, target_root=args.target_root,
        synthetic=args.synthetic,
        synthetic_train=args.synthetic_train or 64,
        synthetic_val=args.synthetic_val or 16,
        crop=tuple(args.crop) if args.crop else None,
        batch_size=args.batch_size, num_workers=args.num_workers,
        source_iters=args.source_iters, calib_iters=args.calib_iters,
        finetune_iters=args.finetune_iters, val_interval=args.val_interval,
        calib_seed=args.calib_seed, cfg_options=dict(args.cfg_options or {}),
        isolate=args.isolate)


def main(argv: Optional[List[str]] = None) -> ProtocolRun:
    args = parse_args(argv)
    try:
        protocol = ProtocolRun(options(args))
        protocol.plan()
    except ValueError as e:  # bad strategy / checkpoint choice: no traceback
        raise SystemExit(f'run_protocol.py: error: {e}') from None
    if args.dry_run:
        protocol.print_plan()
        return protocol
    if not args.report_only:
        protocol.run()
    written = protocol.report()
    with open(written['md']) as f:
        print(f.read())
    return protocol


if __name__ == '__main__':
    main(sys.argv[1:])
