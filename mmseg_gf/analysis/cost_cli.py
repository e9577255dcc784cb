"""What ``tools/analyze_cost.py`` does with a config: cost report, measured
memory and budget sweep, printed and returned as json.

The setting analysed is the one that trains: ``--setting``, else the
config's ``gradient_filter``, else a ``GradFilterHook``'s settings, else
none ("Vanilla BP All").
"""
import argparse
import os.path as osp
from typing import Any, Dict, Optional

from mmengine.config import Config

from ..accounting.report import step_kept_table
from ..engine.config import config_settings
from ..engine.settings import CHOICE_KEYS, SETTING_KEYS
from ..engine.zoo import make_offline
from .budget_sweep import config_sweep, sweep_markdown, sweep_plot
from .cost_report import (cost_summary_lines, measured_memory_table,
                          model_cost_table)
from .measured_memory import measure_memory
from .model_cost import config_backward_cost, config_step_saved_bytes
from .step_benchmark import set_row_settings

__all__ = ['hook_settings', 'load_config', 'report_config', 'sweep']


def hook_settings(cfg: Config) -> Optional[Dict[str, Any]]:
    """The settings of the first ``GradFilterHook`` in ``custom_hooks`` that
    has any, or None."""
    for hook in cfg.get('custom_hooks') or []:
        if not isinstance(hook, dict) or hook.get('type') != 'GradFilterHook':
            continue
        settings = {k: hook[k] for k in SETTING_KEYS
                    if hook.get(k) is not None}
        if any(k in settings for k in CHOICE_KEYS):
            return settings
    return None


def load_config(args: argparse.Namespace) -> Config:
    """The config with ``--cfg-options``, ``--offline`` and ``--setting``
    applied, checked once."""
    cfg = Config.fromfile(args.config)
    if args.cfg_options:
        cfg.merge_from_dict(args.cfg_options)
    if args.offline:
        make_offline(cfg)
    if args.setting is not None:
        set_row_settings(cfg, args.setting)
    elif cfg.get('gradient_filter') is None:
        settings = hook_settings(cfg)
        if settings is not None:
            print(f'setting: the config\'s GradFilterHook {settings}')
            cfg.gradient_filter = settings
    settings = config_settings(cfg)
    if settings is not None:
        cfg.gradient_filter = settings
    return cfg


def report_config(cfg: Config, args: argparse.Namespace) -> Dict[str, Any]:
    """Print and return the config's cost table, summary, kept bytes and
    measured memory."""
    out: Dict[str, Any] = {}
    cost = config_backward_cost(cfg, args.shape, args.batch, args.radius,
                                args.collapse_dilated)
    print(f'config: {args.config}')
    print(model_cost_table(cost))
    for line in cost_summary_lines(cost):
        print(line)
    out.update(config=args.config, cost=cost.as_dict())
    step = config_step_saved_bytes(cfg, args.shape)
    if step is not None:
        print(step_kept_table(step, args.batch))
        out['step_saved_bytes'] = dict(
            total=step.total(args.batch),
            by_category=step.by_category(args.batch),
            unmodelled=step.unmodelled,
            unmodelled_measured=step.unmodelled_bytes(args.batch))
    if args.measure:
        shape = args.measure_shape or args.shape
        result = measure_memory(cfg, shape, batch=args.batch,
                                device=args.device,
                                num_layers=args.measure_layers,
                                radius=args.radius)
        print(f'\nmeasured at {shape[0]}x{shape[1]}, batch '
              f'{args.batch}, {args.device} (saved: autograd\'s '
              'saved_tensors_hooks; peak: ' +
              ('max_memory_allocated' if args.device.startswith('cuda')
               else 'torch profiler, live tensor bytes') + ')')
        print(measured_memory_table(result))
        out['measured'] = result
    return out


def sweep(cfg: Config, args: argparse.Namespace) -> Dict[str, Any]:
    """Print the sweep table (and the budget's choice), plot it."""
    result = config_sweep(cfg, args.shape, args.batch, args.budget)
    error = result['error']
    print(f'\nsettings at {args.shape[0]}x{args.shape[1]}, batch '
          f'{args.batch} (predicted; docs/budget.md)')
    print(sweep_markdown(result['rows'], result['choice']))
    if error:
        print(error)
    if args.out:
        path = osp.splitext(args.out)[0] + '_sweep.png'
        sweep_plot(result['rows'], path, result['limits'],
                   title=osp.basename(args.config))
        print(f'plot: {path}')
    choice = result['choice']
    return dict(rows=result['rows'], radii=result['radii'],
                limits=result['limits'], error=error,
                choice=None if choice is None else dict(
                    num_layers=choice.num_layers, radius=choice.radius,
                    backward_gflops=choice.cost.backward_gflops,
                    saved_mib=choice.cost.saved_mib,
                    peak_mib=choice.cost.peak_mib))
