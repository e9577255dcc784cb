"""What ``tools/benchmark_step.py`` runs: the models, each with its crop and
rows' configs (a :data:`Job`), measured, tabled and written.
"""
import argparse
import os
import os.path as osp
from typing import List, Sequence, Tuple

import torch
from mmengine.config import Config

from ..accounting.format import fmt_mib
from ..engine.config import default_input_size
from ..engine.cpu_memory import cpu_memory_kept
from ..engine.tool_args import write_json
from ..engine.zoo import ZOO_FAMILIES, family_config, make_offline
from .hardware import cpu_model
from .step_benchmark import benchmark_model, row_config
from .step_report import kept_by_kind_table, plot, step_table

__all__ = ['Job', 'add_model_arguments', 'check_model_arguments',
           'family_crop', 'config_jobs',
           'family_jobs', 'run_jobs']

#: A model to measure: name, label, crop, (row, config) pairs.
Job = Tuple[str, str, Tuple[int, int], List[Tuple[str, Config]]]


def add_model_arguments(parser: argparse.ArgumentParser,
                        families: Sequence[str], family_help: str,
                        models: Sequence[str]) -> None:
    """The model arguments every step tool takes (CONFIG, ``--families``,
    ``--models``, ...)."""
    from mmengine.config import DictAction
    parser.add_argument('configs', nargs='*', metavar='CONFIG',
                        help='mmseg config files (any segmentor)')
    parser.add_argument('--families', nargs='+', default=[],
                        choices=sorted(families), help=family_help)
    parser.add_argument('--models', nargs='+', default=[],
                        choices=sorted(models),
                        help="the paper protocol's models")
    parser.add_argument('--dataset', default='voc',
                        help='--models: target dataset of the configs '
                        '(classes)')
    parser.add_argument('--offline', action='store_true',
                        help='adapt CONFIGs for one process without '
                        'downloads: SyncBN -> BN, pretrained / init_cfg '
                        'checkpoints removed (random weights)')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='xxx=yyy settings merged into every CONFIG, '
                        'family and --models config')


def check_model_arguments(parser: argparse.ArgumentParser,
                          args: argparse.Namespace) -> None:
    """Refuse settings that name no model or a missing CONFIG file."""
    if not (args.configs or args.families or args.models):
        parser.error('give CONFIG files, --families or --models')
    for path in args.configs:
        if not osp.isfile(path):
            parser.error(f'config: file {path!r} does not exist')


def family_crop(name: str, args: argparse.Namespace) -> Tuple[int, int]:
    """``--family-crop``, else ``--crop`` raised to the family's minimum, else
    its crop."""
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


def config_jobs(args: argparse.Namespace) -> List[Job]:
    """The ``CONFIG`` files' jobs (``--cfg-options``, ``--offline``)."""
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
    return jobs


def family_jobs(args: argparse.Namespace) -> List[Job]:
    """The ``--families`` jobs, offline (:func:`family_crop`)."""
    jobs: List[Job] = []
    for name in args.families:
        cfg = make_offline(family_config(name))
        if args.cfg_options:
            cfg.merge_from_dict(args.cfg_options)
        crop = family_crop(name, args)
        jobs.append((name, ZOO_FAMILIES[name].label, crop,
                     _rows(cfg, args.rows, crop)))
    return jobs


def run_jobs(jobs: Sequence[Job], args: argparse.Namespace) -> List[dict]:
    """Measure every job's rows, printing and writing the results after each
    model."""
    device = getattr(args, 'device', 'cpu')
    if device == 'cuda' and getattr(args, 'tf32', None) is not None:
        torch.backends.cuda.matmul.allow_tf32 = args.tf32
        torch.backends.cudnn.allow_tf32 = args.tf32
    results = []
    for name, label, crop, rows in jobs:
        result = benchmark_model(
            name, rows, crop, args.batch, args.repeats, args.warmup,
            args.memory, label=label, device=device,
            compile_mode=getattr(args, 'compile_mode', None),
            progress=lambda msg, name=name: print(f'[{name}] {msg}',
                                                  flush=True))
        result['cpu'] = cpu_model()
        result['reuse_cpu_memory'] = cpu_memory_kept()
        if device == 'cuda':
            result['tf32'] = dict(
                cudnn=torch.backends.cudnn.allow_tf32,
                matmul=torch.backends.cuda.matmul.allow_tf32)
        results.append(result)
        where = (f'{result["gpu"]}' if result.get('gpu') else
                 f'{result["threads"]} threads')
        print(f'\n{label}, crop {crop[0]}x{crop[1]}, batch {args.batch}, '
              f'{where}, torch {result["torch"]}; '
              + (f'training rows compiled ({result["compile"]}); '
                 if result.get('compile') else '') +
              f'median of {args.repeats} steps'
              + ('; freed CPU memory reused' if result['reuse_cpu_memory']
                 else '')
              + (f'; resident after them '
                 f'{fmt_mib(result["resident_bytes"], 0, " MiB")}, at most '
                 f'{fmt_mib(result["peak_resident_bytes"], 0, " MiB")}'
                 if result['resident_bytes'] else ''))
        print(step_table(result), flush=True)
        by_kind = kept_by_kind_table(result)
        if by_kind:
            print(f'\n{by_kind}', flush=True)
        # after every model: a later model's failure keeps these
        _write_results(results, args.out_dir)
    return results


def _write_results(results: Sequence[dict], out_dir: str) -> None:
    """``steps.json``, ``steps.md`` and ``steps.png`` of the models so far."""
    os.makedirs(out_dir, exist_ok=True)
    write_json(osp.join(out_dir, 'steps.json'), results)
    with open(osp.join(out_dir, 'steps.md'), 'w') as f:
        for result in results:
            f.write(f"## {result['label']}, crop {result['crop'][0]}x"
                    f"{result['crop'][1]}\n\n{step_table(result)}\n\n")
            by_kind = kept_by_kind_table(result)
            if by_kind:
                f.write(f'Kept for backward by kind (analytic count):\n\n'
                        f'{by_kind}\n\n')
    if plot(results, osp.join(out_dir, 'steps.png')):
        print(f"wrote {osp.join(out_dir, 'steps.png')}")
