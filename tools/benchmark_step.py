"""Whole training steps of gradient-filter settings next to inference.

For each model (mmseg config files, real-time families of mmseg's zoo by
name, or the protocol's models), time the rows (inference and settings such
as ``gf_last5_r4:lean``, ``vanilla_last5:plain``) on one random batch at the
crop and measure the step's peak live bytes and the bytes kept for backward,
all in one process; see :mod:`mmseg_gf.analysis.step_benchmark`. Writes
``steps.json``, ``steps.md`` and ``steps.png`` to ``--out-dir``.

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
"""
import argparse
import os
import os.path as osp
from typing import List, Optional, Sequence, Tuple

import torch
from mmengine.config import Config, DictAction

import mmseg_gf  # noqa: F401  (registers the plugin's modules)
from mmseg_gf.accounting.format import fmt_mib
from mmseg_gf.analysis.hardware import cpu_model
from mmseg_gf.analysis.step_benchmark import (DEFAULT_ROWS, benchmark_model,
                                              plot, row_config, row_settings,
                                              step_table)
from mmseg_gf.engine.config import default_input_size
from mmseg_gf.engine.cpu_memory import cpu_memory_kept, keep_freed_cpu_memory
from mmseg_gf.engine.tool_args import write_json
from mmseg_gf.engine.zoo import (REALTIME_FAMILIES, ZOO_FAMILIES,
                                 family_config, make_offline)
from mmseg_gf.protocol import PROTOCOL_MODELS
from mmseg_gf.protocol.experiments import step_row_config

#: A model to measure: name, label, crop, (row, config) pairs.
Job = Tuple[str, str, Tuple[int, int], List[Tuple[str, Config]]]


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('configs', nargs='*', metavar='CONFIG',
                   help='mmseg config files (any segmentor)')
    p.add_argument('--families', nargs='+', default=[],
                   choices=sorted(ZOO_FAMILIES) + ['all'],
                   help="families of mmseg's zoo by name "
                   "(mmseg_gf/engine/zoo.py: the twelve real-time ones, "
                   "'all' of them, and the transformers segformer_b2, "
                   "twins_pcpvt_s, swin_t), offline")
    p.add_argument('--models', nargs='+', default=[],
                   choices=sorted(PROTOCOL_MODELS),
                   help="the paper protocol's models")
    p.add_argument('--dataset', default='voc',
                   help='--models: target dataset of the configs (classes)')
    p.add_argument('--offline', action='store_true',
                   help='adapt CONFIGs for one process without downloads: '
                   'SyncBN -> BN, pretrained / init_cfg checkpoints removed '
                   '(random weights)')
    p.add_argument('--cfg-options', nargs='+', action=DictAction,
                   help='xxx=yyy settings merged into every CONFIG, family '
                   'and --models config')
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
    if not (args.configs or args.families or args.models):
        p.error('give CONFIG files, --families or --models')
    for path in args.configs:
        if not osp.isfile(path):
            p.error(f'config: file {path!r} does not exist')
    for row in args.rows:
        try:
            row_settings(row)
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


def _family_crop(name: str, args) -> Tuple[int, int]:
    """``--family-crop``, else ``--crop`` raised to the family's minimum
    side, else its training crop."""
    family = ZOO_FAMILIES[name]
    if name in args.family_crop:
        side = int(args.family_crop[name])
        return side, side
    if args.crop is None:
        return family.crop
    crop = tuple(max(int(v), family.min_crop) for v in args.crop)
    if crop != tuple(args.crop):
        print(f'[{name}] crop {crop[0]}x{crop[1]}: the smallest it runs at '
              f'({family.why})')
    return crop


def _rows(cfg: Config, rows: Sequence[str], crop) -> List[Tuple[str, Config]]:
    return [(row, row_config(cfg, row, crop)) for row in rows]


def _jobs(args) -> List[Job]:
    """Every model's rows, configs composed (nothing built yet)."""
    jobs: List[Job] = []
    for path in args.configs:
        cfg = Config.fromfile(path)
        if args.cfg_options:
            cfg.merge_from_dict(args.cfg_options)
        if args.offline:
            make_offline(cfg)
        crop = tuple(args.crop or default_input_size(cfg))
        name = osp.splitext(osp.basename(path))[0]
        jobs.append((name, name, crop, _rows(cfg, args.rows, crop)))
    for name in args.families:
        cfg = make_offline(family_config(name))
        if args.cfg_options:
            cfg.merge_from_dict(args.cfg_options)
        crop = _family_crop(name, args)
        jobs.append((name, ZOO_FAMILIES[name].label, crop,
                     _rows(cfg, args.rows, crop)))
    for name in args.models:
        crop = tuple(args.crop or (512, 512))
        rows = []
        for row in args.rows:
            cfg = step_row_config(name, args.dataset, row, crop)
            if args.cfg_options:
                cfg.merge_from_dict(args.cfg_options)
            rows.append((row, cfg))
        jobs.append((name, PROTOCOL_MODELS[name].label, crop, rows))
    return jobs


def main(argv: Optional[List[str]] = None) -> List[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.reuse_cpu_memory and not keep_freed_cpu_memory():
        raise SystemExit('--reuse-cpu-memory: the C library has no glibc '
                         'mallopt')
    results = []
    for name, label, crop, rows in _jobs(args):
        result = benchmark_model(
            name, rows, crop, args.batch, args.repeats, args.warmup,
            args.memory, label=label,
            progress=lambda msg, name=name: print(f'[{name}] {msg}',
                                                  flush=True))
        result['cpu'] = cpu_model()
        result['reuse_cpu_memory'] = cpu_memory_kept()
        results.append(result)
        print(f'\n{label}, crop {crop[0]}x{crop[1]}, batch {args.batch}, '
              f'{result["threads"]} threads, torch {result["torch"]}; '
              f'median of {args.repeats} steps'
              + ('; freed CPU memory reused' if result['reuse_cpu_memory']
                 else '')
              + (f'; resident after them '
                 f'{fmt_mib(result["resident_bytes"], 0, " MiB")}, at most '
                 f'{fmt_mib(result["peak_resident_bytes"], 0, " MiB")}'
                 if result['resident_bytes'] else ''))
        print(step_table(result), flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    write_json(osp.join(args.out_dir, 'steps.json'), results)
    with open(osp.join(args.out_dir, 'steps.md'), 'w') as f:
        for result in results:
            f.write(f"## {result['label']}, crop {result['crop'][0]}x"
                    f"{result['crop'][1]}\n\n{step_table(result)}\n\n")
    if plot(results, osp.join(args.out_dir, 'steps.png')):
        print(f"wrote {osp.join(args.out_dir, 'steps.png')}")
    return results


if __name__ == '__main__':
    main()
