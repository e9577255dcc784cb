"""How one protocol run's config is composed from the ``configs/_base_``
pieces (:mod:`.experiments`).

A run's config is always the same four bases plus one line of glue::

    _base_ = ['configs/_base_/models/<model>.py',
              'configs/_base_/datasets/<dataset>.py',
              'configs/_base_/default_runtime.py',
              'configs/_base_/strategies/<strategy>.py']
    model = dict(data_preprocessor=dict(size=_base_.crop_size),
                 decode_head=dict(num_classes=_base_.num_classes))

(the concrete files in ``configs/gf`` and ``configs/calib`` are exactly
this), followed by run-specific settings (data location, crop, iterations,
seed, checkpoint) applied by :func:`adapt_config`. The final config of every
run is dumped to ``<work_dir>/config.py`` and runs on its own with
``tools/train.py``.
"""
import math
import os.path as osp
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mmengine.config import Config
from mmseg.registry import MODELS as SEGMENTORS
from mmseg.utils import register_all_modules

from ..engine.budget import profile_segmentor
from ..engine.config import (add_custom_hook, add_custom_imports,
                             default_input_size, patch_means_on)
from .experiments import (CONFIG_DIR, PROTOCOL_DATASETS, PROTOCOL_MODELS,
                          STRATEGIES, strategy_file)

__all__ = ['compose_config', 'fill_budget', 'set_data', 'rescale_schedule',
           'adapt_config', 'step_row_config', 'step_jobs']


def compose_config(model: str,
                   dataset: str,
                   strategy: str,
                   config_dir: str = CONFIG_DIR) -> Config:
    """model + dataset + runtime + strategy bases, with the glue line.

    Args:
        model: a key of :data:`PROTOCOL_MODELS`.
        dataset: a key of :data:`PROTOCOL_DATASETS`.
        strategy: a key of :data:`STRATEGIES`, ``'pretrain_source'`` or a
            path to a strategy file.
        config_dir: the ``configs`` directory.
    """
    if model not in PROTOCOL_MODELS:
        raise ValueError(
            f'unknown model {model!r}; one of {list(PROTOCOL_MODELS)}')
    if dataset not in PROTOCOL_DATASETS:
        raise ValueError(
            f'unknown dataset {dataset!r}; one of {list(PROTOCOL_DATASETS)}')
    base = osp.join(config_dir, '_base_')
    if strategy == 'pretrain_source':
        strat = osp.join(base, 'strategies', 'pretrain_source.py')
    else:
        strat = strategy_file(strategy, model, config_dir)
    bases = [
        osp.join(base, 'models', PROTOCOL_MODELS[model].base),
        osp.join(base, 'datasets', PROTOCOL_DATASETS[dataset].base),
        osp.join(base, 'default_runtime.py'), strat
    ]
    text = (f'_base_ = {bases!r}\n'
            'model = dict(data_preprocessor=dict(size=_base_.crop_size), '
            'decode_head=dict(num_classes=_base_.num_classes))\n')
    cfg = Config.fromstring(text, '.py')
    spec = STRATEGIES.get(strategy)
    if spec is not None and spec.options:
        cfg.merge_from_dict(dict(spec.options))
    return cfg


def fill_budget(cfg: Config, strategy: str, model: str,
                config_dir: str = CONFIG_DIR) -> Config:
    """Set a budget strategy's ``backward_gflops`` for this model, in place.

    The value is the predicted backward GFLOPs per image, at the config's
    crop, of the strategy named by :attr:`StrategySpec.budget_like`
    (its ``num_layers`` and ``radius``), from the same profile of the
    model that the budget's choice uses; other strategies are returned
    unchanged.
    """
    spec = STRATEGIES.get(strategy)
    if spec is None or spec.budget_like is None:
        return cfg
    register_all_modules(init_default_scope=False)
    like = Config.fromfile(strategy_file(spec.budget_like, model, config_dir))
    setting = like.gradient_filter
    segmentor = SEGMENTORS.build(cfg.model)
    settings = cfg.get('gradient_filter') or {}
    profile = profile_segmentor(
        segmentor, default_input_size(cfg),
        layer_kinds=settings.get('layer_kinds'),
        patch_mean_activations=patch_means_on(settings))
    gflops = profile.cost(setting['num_layers'], setting['radius'],
                          1).backward_gflops
    budget = dict(cfg.gradient_filter.budget)
    # a hair above, so that the setting itself fits despite rounding
    budget['backward_gflops'] = gflops * (1 + 1e-9)
    cfg.gradient_filter.budget = budget
    return cfg


def _iter_datasets(ds: dict):
    """The leaf dataset dicts of a (Concat/Repeat) dataset config."""
    if ds.get('type') == 'ConcatDataset' or 'datasets' in ds:
        for d in ds['datasets']:
            yield from _iter_datasets(d)
    elif 'dataset' in ds:
        yield from _iter_datasets(ds['dataset'])
    else:
        yield ds


def set_data(cfg: Config,
             data_root: Optional[str] = None,
             image_size: Optional[Sequence[int]] = None,
             crop: Optional[Sequence[int]] = None) -> Config:
    """Move the datasets and resize their pipelines, in place.

    Args:
        cfg: a composed config.
        data_root: new ``data_root`` of every train/val/test dataset.
        image_size: ``(H, W)`` the images are resized to (``RandomResize``
            and test ``Resize`` scales; the random ratio range is kept), for
            data much smaller than the real datasets.
        crop: ``(H, W)`` training crop (``RandomCrop``, ``Pad`` and the
            data preprocessor's size).
    """
    for key in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        loader = cfg.get(key)
        if not loader:
            continue
        for ds in _iter_datasets(loader['dataset']):
            if data_root is not None:
                ds['data_root'] = data_root
            for t in ds.get('pipeline', []):
                kind = t.get('type')
                if image_size is not None and kind in ('RandomResize',
                                                       'Resize'):
                    if 'scale' in t:
                        t['scale'] = (int(image_size[1]), int(image_size[0]))
                if crop is not None and kind == 'RandomCrop':
                    t['crop_size'] = tuple(int(v) for v in crop)
                if crop is not None and kind == 'Pad' and 'size' in t:
                    t['size'] = tuple(int(v) for v in crop)
    if crop is not None:
        crop = tuple(int(v) for v in crop)
        cfg.crop_size = crop
        cfg.model.data_preprocessor['size'] = crop
    return cfg


def _scale(x: float, f: float, max_iters: int) -> int:
    return 0 if x <= 0 else min(max_iters, max(1, math.ceil(x * f)))


def rescale_schedule(cfg: Config,
                     max_iters: int,
                     val_interval: Optional[int] = None) -> Config:
    """Change the number of iterations, keeping the schedule's shape.

    Every ``param_scheduler`` keeps its place relative to the run (a 1000
    of 20000 warm-up stays 5%); ``CosineAnnealingLR`` gets the new
    ``T_max``; ``ExponentialLR`` a gamma with the same total decay.
    Validation and checkpoints happen every ``val_interval`` iterations
    (default: as many validations as before), and always at the end.
    """
    max_iters = int(max_iters)
    if max_iters < 1:
        raise ValueError(f'max_iters must be >= 1, got {max_iters}')
    old = int(cfg.train_cfg.max_iters)
    f = max_iters / old
    scheds = cfg.get('param_scheduler') or []
    if isinstance(scheds, dict):
        scheds = [scheds]
    for s in scheds:
        begin, end = s.get('begin', 0), s.get('end', old)
        end = old if end is None or end > old else end
        nb, ne = _scale(begin, f, max_iters), _scale(end, f, max_iters)
        if ne <= nb:
            ne = nb + 1
        if s.get('type') in ('CosineAnnealingLR', 'CosineAnnealingParamScheduler'):
            s['T_max'] = ne - nb
        if s.get('type') in ('ExponentialLR', 'ExponentialParamScheduler'):
            s['gamma'] = float(s['gamma'])**((end - begin) / (ne - nb))
        s['begin'], s['end'] = nb, ne
    cfg.train_cfg.max_iters = max_iters
    if val_interval is None:
        n_val = max(1, round(old / int(cfg.train_cfg.get('val_interval',
                                                          old))))
        val_interval = max(1, math.ceil(max_iters / n_val))
    val_interval = min(int(val_interval), max_iters)
    cfg.train_cfg.val_interval = val_interval
    ckpt = cfg.default_hooks.get('checkpoint')
    if ckpt is not None:
        ckpt['interval'] = val_interval
    logger = cfg.default_hooks.get('logger')
    if logger is not None:
        logger['interval'] = max(1, min(int(logger.get('interval', 50)),
                                        val_interval))
    return cfg


def adapt_config(cfg: Config,
                 work_dir: str,
                 seed: int,
                 data_root: Optional[str] = None,
                 image_size: Optional[Sequence[int]] = None,
                 crop: Optional[Sequence[int]] = None,
                 max_iters: Optional[int] = None,
                 val_interval: Optional[int] = None,
                 batch_size: Optional[int] = None,
                 num_workers: Optional[int] = None,
                 load_from: Optional[str] = None,
                 cfg_options: Optional[Dict[str, Any]] = None) -> Config:
    """The run-specific settings of one protocol run, in place.

    Besides the arguments: keep one checkpoint (the last), record every
    validation (``ValMetricsRecorderHook``) and draw nothing.
    ``cfg_options`` (the CLI's ``--cfg-options``) is merged last.
    """
    set_data(cfg, data_root, image_size, crop)
    if max_iters is not None or val_interval is not None:
        rescale_schedule(cfg, max_iters or cfg.train_cfg.max_iters,
                         val_interval)
    if batch_size is not None:
        cfg.train_dataloader.batch_size = int(batch_size)
    if num_workers is not None:
        for key in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
            cfg[key]['num_workers'] = int(num_workers)
            cfg[key]['persistent_workers'] = int(num_workers) > 0
    cfg.randomness = dict(seed=int(seed))
    cfg.work_dir = work_dir
    cfg.load_from = load_from
    ckpt = cfg.default_hooks.get('checkpoint')
    if ckpt is not None:
        ckpt['max_keep_ckpts'] = 1
    vis = cfg.default_hooks.get('visualization')
    if vis is not None:
        vis['draw'] = False
    add_custom_hook(cfg, 'ValMetricsRecorderHook')
    add_custom_imports(cfg, 'mmseg_gf', 'mmseg_gf.engine.hooks')
    if cfg_options:
        cfg.merge_from_dict(dict(cfg_options))
    return cfg


def step_row_config(model: str, dataset: str, row: str,
                    crop: Sequence[int]) -> Config:
    """The config of one ``tools/benchmark_step.py`` row of a protocol
    model: ``'inference'`` (the plain model, ``vanilla_all``) or a strategy
    with an optional ``:lean`` / ``:plain`` suffix for the gradient-filter
    setting ``lean``, its data at ``crop``."""
    strategy, _, variant = row.partition(':')
    cfg = compose_config(model, dataset,
                         'vanilla_all' if row == 'inference' else strategy)
    set_data(cfg, crop=crop)
    if row != 'inference' and cfg.get('gradient_filter') is not None:
        cfg.gradient_filter = dict(cfg.gradient_filter,
                                   lean=variant != 'plain')
    return cfg


def step_jobs(models: Sequence[str], dataset: str, rows: Sequence[str],
              crop: Sequence[int], cfg_options: Optional[dict] = None
              ) -> List[Tuple[str, str, Tuple[int, int], List]]:
    """The protocol models' jobs for the step tools
    (:data:`mmseg_gf.analysis.step_jobs.Job`): each model's name, label,
    ``crop`` and :func:`step_row_config` per row, ``cfg_options`` merged."""
    jobs = []
    for name in models:
        configs = []
        for row in rows:
            cfg = step_row_config(name, dataset, row, crop)
            if cfg_options:
                cfg.merge_from_dict(cfg_options)
            configs.append((row, cfg))
        jobs.append((name, PROTOCOL_MODELS[name].label, tuple(crop),
                     configs))
    return jobs
