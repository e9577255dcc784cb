"""The flags of ``tools/analyze_cost.py`` that analyse a config, and their
checks, beside what reads them (:mod:`.cost_cli`) so the tool stays thin.
"""
import argparse
import os.path as osp

from mmengine.config import DictAction

from ..engine.zoo import ZOO_FAMILIES
from .step_benchmark import row_settings

__all__ = ['add_model_args', 'add_measure_args', 'add_setting_args',
           'check_cost_args']


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """Which model is counted and how: config or family, shape, batch, radius,
    json."""
    parser.add_argument('config', nargs='?', help='config file path')
    parser.add_argument(
        '--family', choices=sorted(ZOO_FAMILIES),
        help="a family of mmseg's zoo by name instead of a config file "
        '(mmseg_gf/engine/zoo.py: the real-time and transformer '
        'families), built as with --offline')
    parser.add_argument('--shape', type=int, nargs='+', default=[512, 512],
                        help='input image size: H [W] (default 512 512)')
    parser.add_argument('--batch', type=int, default=1,
                        help='images per step the counts are for '
                        '(default 1: per image, as the paper)')
    parser.add_argument(
        '--radius', type=int, default=4,
        help='patch size of the GF columns for a config without '
        'gradient_filter (default 4)')
    parser.add_argument(
        '--collapse-dilated', action='store_true',
        help='count the GF backward of dilated convs as the public '
        'reference operator does (kernel summed to one tap) instead of '
        "this plugin's operator (taps kept on the pooled grid)")
    parser.add_argument('--out', help='write the numbers to this json file')


def add_measure_args(parser: argparse.ArgumentParser) -> None:
    """``--measure`` and its shape, trained layers and device."""
    parser.add_argument(
        '--measure', action='store_true',
        help='also measure, GF vs vanilla on the same layers: the bytes '
        'autograd saves per trained conv and the peak memory of one '
        'training step')
    parser.add_argument('--measure-shape', type=int, nargs='+', default=None,
                        help='H [W] of the measured step (default --shape)')
    parser.add_argument('--measure-layers', type=int, default=5,
                        help='N for --measure on a config without '
                        'gradient_filter: its last N convs (default 5)')
    parser.add_argument('--device', default='cpu',
                        help='device of the measured step (cpu, cuda)')


def add_setting_args(parser: argparse.ArgumentParser) -> None:
    """The sweep and its budget, and ``--cfg-options``, ``--setting``,
    ``--offline``."""
    parser.add_argument(
        '--sweep', action='store_true',
        help='for N = 1 .. all and each radius: predicted backward GFLOPs '
        'per image, bytes kept for backward and step peak at --shape and '
        '--batch (a plot next to --out)')
    parser.add_argument(
        '--budget', nargs='+', action=DictAction,
        help='--sweep: limits to mark and choose by, e.g. saved_mib=60 '
        'peak_mib=600 backward_gflops=1 radii=[2,4,8] (default: the '
        "config's gradient_filter budget)")
    parser.add_argument(
        '--cfg-options', nargs='+', action=DictAction,
        help='override some settings in the used config, the key-value '
        'pair in xxx=yyy format will be merged into config file.')
    parser.add_argument(
        '--setting', help="the config's gradient_filter by name, as "
        "tools/benchmark_step.py's rows: vanilla_last<N>, gf_last<N>_r<R>, "
        'gf_last<N>_auto (optionally :lean / :plain); vanilla_all: none. '
        "Default: the config's gradient_filter, else its GradFilterHook's "
        'settings')
    parser.add_argument(
        '--offline', action='store_true',
        help='adapt a config of mmseg\'s zoo for one process without '
        'downloads: SyncBN -> BN, pretrained / init_cfg checkpoints removed')


def check_cost_args(parser: argparse.ArgumentParser,
                    args: argparse.Namespace) -> argparse.Namespace:
    """Check and complete the parsed flags together; bad combinations end via
    ``parser.error``."""
    _resolve_config(parser, args)
    _pair_shapes(parser, args)
    if args.batch < 1:
        parser.error('--batch must be >= 1')
    if (args.sweep or args.budget) and not args.config:
        parser.error('--sweep / --budget need a config file')
    _check_setting(parser, args)
    return args


def _resolve_config(parser: argparse.ArgumentParser,
                    args: argparse.Namespace) -> None:
    """The config: ``--family`` (zoo, offline) or an existing file, unless only
    Table 3."""
    if args.family is not None:
        if args.config:
            parser.error('give a config file or --family, not both')
        args.config, args.offline = ZOO_FAMILIES[args.family].path, True
    if not args.paper_table3 and not args.config:
        parser.error('give a config file, --family, or --paper-table3')
    if args.config and not osp.isfile(args.config):
        parser.error(f'config: file {args.config!r} does not exist')


def _pair_shapes(parser: argparse.ArgumentParser,
                 args: argparse.Namespace) -> None:
    """``--shape`` and ``--measure-shape`` as positive ``[H, W]``."""
    for name in ('shape', 'measure_shape'):
        value = getattr(args, name)
        if value is None:
            continue
        if len(value) == 1:
            value = [value[0], value[0]]
        if len(value) != 2 or min(value) < 1:
            parser.error(f'--{name.replace("_", "-")}: H [W], positive')
        setattr(args, name, value)


def _check_setting(parser: argparse.ArgumentParser,
                   args: argparse.Namespace) -> None:
    """``--setting`` is a training benchmark row that parses."""
    if args.setting is None:
        return
    if args.setting == 'inference':
        parser.error("--setting: a gradient-filter setting "
                     "(vanilla_all, vanilla_last<N>, gf_last<N>_r<R>, "
                     "gf_last<N>_auto), not 'inference'")
    try:
        row_settings(args.setting)
    except ValueError as e:
        parser.error(f'--setting: {e}')
