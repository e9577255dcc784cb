"""Whole training steps of gradient-filter settings next to inference.

For each model (mmseg config files, real-time families of mmseg's zoo by
name, or the protocol's models), time the rows (inference and settings such
as ``gf_last5_r4:lean``, ``vanilla_last5:plain``) on one random batch at the
crop and measure the step's peak live bytes and the bytes kept for backward,
all in one process; see :mod:`mmseg_gf.analysis.step_benchmark` (the run:
:mod:`mmseg_gf.analysis.step_jobs`). Writes ``steps.json``, ``steps.md``
and ``steps.png`` to ``--out-dir``.

Examples::

    # any mmseg config; --offline: SyncBN -> BN, no pretrained checkpoint
    python tools/benchmark_step.py my_config.py --offline --crop 512 \
        --batch 8 --rows inference vanilla_last5:plain gf_last5_r4:lean
    # mmseg's real-time families by name (always offline)
    python tools/benchmark_step.py --families segformer_b0 stdc1 \
        --crop 256 --batch 2 --repeats 0
    # the protocol's models (their own configs, the VOC classes)
    python tools/benchmark_step.py --models pspnet_r18 fcn_r18 \
        --crop 512 512 --batch 8 --out-dir work_dirs/benchmarks/steps
    # on a CUDA GPU (times synchronised, peak = max_memory_allocated)
    python tools/benchmark_step.py --models pspnet_r18 --device cuda \
        --rows inference vanilla_last10:plain gf_last10_r4:lean
    # compiled (Inductor) and eager steps side by side, one run
    python tools/benchmark_step.py --models pspnet_r18 --crop 256 \
        --batch 2 --warmup 2 --no-memory --rows gf_last10_r4:lean \
        gf_last10_r4:lean+compiled
    # the training rows compiled, CUDA graphs replayed
    python tools/benchmark_step.py --models pspnet_r18 --device cuda \
        --compile reduce-overhead --warmup 2 --no-memory \
        --rows inference vanilla_last10:plain gf_last10_r4:lean
"""
import argparse
from typing import List, Optional

import torch
from mmengine.config import DictAction

import mmseg_gf  # noqa: F401  (registers the plugin's modules)
from mmseg_gf.analysis.step_benchmark import (COMPILE_MODES, DEFAULT_ROWS,
                                              row_settings)
from mmseg_gf.analysis.step_jobs import (Job, add_model_arguments,
                                         check_model_arguments,
                                         config_jobs, family_jobs,
                                         run_jobs)
from mmseg_gf.engine.cpu_memory import keep_freed_cpu_memory
from mmseg_gf.engine.zoo import (REALTIME_FAMILIES, TRANSFORMER_FAMILIES,
                                 ZOO_FAMILIES)
from mmseg_gf.protocol import PROTOCOL_MODELS
from mmseg_gf.protocol.experiments import strategy_file
from mmseg_gf.protocol.run_config import step_jobs


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    add_model_arguments(
        p, list(ZOO_FAMILIES) + ['all', 'transformers'],
        "families of mmseg's zoo by name (mmseg_gf/engine/zoo.py: the twelve "
        "real-time ones, 'all' of them, and the transformers segformer_b2, "
        "twins_pcpvt_s, swin_t, deit_s, segmenter_vit_t; 'transformers': "
        "those and segformer_b0), offline", PROTOCOL_MODELS)
    p.add_argument('--rows', nargs='+', default=list(DEFAULT_ROWS),
                   help="'inference' and gradient-filter settings: "
                   "vanilla_all, vanilla_last<N>, gf_last<N>_r<R>, "
                   "gf_last<N>_auto, suffixed :lean or :plain")
    p.add_argument('--crop', '--shape', type=int, nargs='+', default=None,
                   metavar='H [W]',
                   help="input size (default: a CONFIG's own crop, a "
                   "family's training crop, 512 512 for --models); a family "
                   "with a larger minimum runs at its minimum")
    p.add_argument('--family-crop', nargs='+', action=DictAction,
                   default={}, metavar='NAME=SIZE',
                   help='per family, a square crop side instead of --crop, '
                   'e.g. lraspp_mv3=512')
    p.add_argument('--batch', type=int, default=8)
    p.add_argument('--repeats', type=int, default=2,
                   help='timed steps per row (median); 0: memory only')
    p.add_argument('--warmup', type=int, default=1)
    p.add_argument('--no-memory', dest='memory', action='store_false',
                   help='time the rows only (no peak / saved bytes)')
    p.add_argument('--threads', type=int, default=None)
    p.add_argument('--device', default='cpu', choices=['cpu', 'cuda'],
                   help="where the rows run ('cuda': the current CUDA "
                   "device; TF32 as torch's defaults and --tf32 set it)")
    p.add_argument('--tf32', action=argparse.BooleanOptionalAction,
                   default=None,
                   help='CUDA: allow TF32 in cuDNN convolutions and cuBLAS '
                   'matrix products (default: torch\'s own defaults, '
                   'recorded in steps.json)')
    p.add_argument('--compile', dest='compile_mode', default=None,
                   choices=COMPILE_MODES,
                   help="the training rows' model.loss compiled with this "
                   "torch.compile mode ('reduce-overhead': CUDA graphs on a "
                   'GPU; compiled in the warm-up rounds: give --warmup 2); '
                   "with rows suffixed '+compiled' only those (default "
                   "mode 'default'), timed next to their eager twins; "
                   'inference stays eager')
    p.add_argument('--reuse-cpu-memory', action='store_true',
                   help='keep freed CPU memory for reuse, as training with '
                   'gradient_filter reuse_cpu_memory=True does (every row, '
                   'inference included: the setting is process-wide)')
    p.add_argument('--out-dir', default='work_dirs/benchmarks/steps')
    args = p.parse_args(argv)
    _check_args(p, args)
    return args


def _check_args(p: argparse.ArgumentParser, args) -> None:
    """Every bad setting is refused before any model is built."""
    if 'all' in args.families:
        args.families = list(REALTIME_FAMILIES)
    elif 'transformers' in args.families:
        args.families = ['segformer_b0', *TRANSFORMER_FAMILIES]
    check_model_arguments(p, args)
    for row in args.rows:
        try:
            row_settings(row)
            if row != 'inference':  # the protocol's models: its strategies
                for model in args.models:
                    strategy_file(row.partition(':')[0], model)
        except ValueError as e:
            p.error(f'--rows: {e}')
    if args.crop is not None:
        if len(args.crop) == 1:
            args.crop = args.crop * 2
        if len(args.crop) != 2 or min(args.crop) < 1:
            p.error('--crop: H [W], positive')
    unknown = set(args.family_crop) - set(args.families)
    if unknown:
        p.error(f'--family-crop: {sorted(unknown)} not among --families')
    if args.batch < 1 or args.repeats < 0 or args.warmup < 0:
        p.error('--batch >= 1, --repeats >= 0 and --warmup >= 0')
    if args.device == 'cuda' and not torch.cuda.is_available():
        p.error('--device cuda: no CUDA GPU is available to this torch '
                f'({torch.__version__})')


def _jobs(args) -> List[Job]:
    """Every model's rows, configs composed (nothing built yet): CONFIG
    files, then families, then the protocol's models."""
    return config_jobs(args) + family_jobs(args) + step_jobs(
        args.models, args.dataset, args.rows, args.crop or (512, 512),
        args.cfg_options)


def main(argv: Optional[List[str]] = None) -> List[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.reuse_cpu_memory and not keep_freed_cpu_memory():
        raise SystemExit('--reuse-cpu-memory: the C library has no glibc '
                         'mallopt')
    return run_jobs(_jobs(args), args)


if __name__ == '__main__':
    main()
