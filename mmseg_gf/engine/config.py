"""Config support: the ``GradFilterModel`` builder and ``rewrite_config``.

A top-level ``gradient_filter = dict(...)`` in an mmseg config becomes a
``GradFilterModel`` whose builder returns the plain segmentor with filtered
layers swapped in, so checkpoints keep mmseg's keys; an unchanged config
with ``custom_hooks=[dict(type='GradFilterHook', ...)]`` is equivalent.
"""
import copy
from dataclasses import replace
from typing import Any, Dict, Optional, Sequence, Union

import torch
from mmseg.registry import MODELS
from torch import nn

from .budget import choose_layers_by_budget
from .cpu_distributed import revert_sync_batchnorm_on_cpu
from .patch_mean_activations import install_patch_mean_gelus
from .selection import select_layers
from .settings import (DEFAULT_INPUT_SIZE, DEFAULTS, SETTING_KEYS,
                       GradientFilterSettings, as_settings, check_settings)
from .state import get_state
from .surgery import apply_gradient_filter

__all__ = [
    'SETTING_KEYS', 'check_settings', 'build_grad_filter_model',
    'rewrite_config', 'add_custom_hook', 'add_custom_imports',
    'default_input_size', 'default_batch_size', 'patch_means_on',
    'select_and_apply', 'config_settings'
]

#: Settings as the public functions take them: checked, or a dict checked
#: once on entry (:func:`~.settings.as_settings`).
SettingsLike = Union[GradientFilterSettings, Dict[str, Any]]


def default_input_size(cfg) -> Sequence[int]:
    """Trace size from a config: data_preprocessor size, crop_size or 512."""
    model = cfg.get('model', {}) or {}
    if model.get('type') == 'GradFilterModel':
        model = model.get('model', {})
    size = (model.get('data_preprocessor') or {}).get('size')
    if size is None:
        size = (cfg.get('data_preprocessor') or {}).get('size')
    if size is None:
        size = cfg.get('crop_size')
    if size is None:
        return DEFAULT_INPUT_SIZE
    if isinstance(size, int):
        return (size, size)
    return (int(size[0]), int(size[1]))


def config_settings(cfg) -> Optional[GradientFilterSettings]:
    """A config's ``gradient_filter`` as checked settings, or None.

    Raises:
        ValueError: as :func:`check_settings`.
    """
    given = cfg.get('gradient_filter')
    return None if given is None else as_settings(given)


def default_batch_size(cfg) -> Optional[int]:
    """Images per training step from a config (None if it has none)."""
    try:
        return int(cfg.train_dataloader.batch_size)
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def default_optimizer(cfg) -> Optional[dict]:
    """The config's ``optim_wrapper.optimizer`` as a dict, for a budget's
    peaks."""
    try:
        optimizer = cfg.optim_wrapper.optimizer
    except (AttributeError, KeyError, TypeError):
        return None
    if not isinstance(optimizer, dict) or 'type' not in optimizer:
        return None
    to_dict = getattr(optimizer, 'to_dict', None)
    return to_dict() if to_dict is not None else dict(optimizer)


def build_grad_filter_model(model: dict,
                            *,
                            data_preprocessor: Optional[dict] = None,
                            settings: Optional[SettingsLike] = None,
                            **kwargs: Any) -> nn.Module:
    """Build a segmentor and gradient-filter its chosen layers.

    Registered as ``GradFilterModel``. Returns the segmentor itself, so its
    ``state_dict`` keys are plain mmseg keys; the choices are kept in its
    :class:`~mmseg_gf.engine.state.GradientFilterState`, so GradFilterHook
    does not apply them again.

    Args:
        model: the segmentor config.
        data_preprocessor: the Runner's top-level ``data_preprocessor``,
            forwarded to the segmentor config if that has none.
        settings: the settings as one object or dict, instead of keywords.
        **kwargs: the settings as keywords
            (:class:`~mmseg_gf.engine.settings.GradientFilterSettings`);
            ``input_size`` defaults to 512.

    Raises:
        ValueError: a setting :func:`check_settings` refuses, or settings
            given both as ``settings`` and as keywords.
    """
    if settings is not None and kwargs:
        raise ValueError(
            'GradFilterModel: give the settings either as settings=... or '
            f'as keywords, not both; got settings and {sorted(kwargs)}')
    settings = as_settings(kwargs if settings is None else settings)
    model = copy.deepcopy(model)
    if data_preprocessor is not None:
        model.setdefault('data_preprocessor', data_preprocessor)
    segmentor = MODELS.build(model)
    if not torch.cuda.is_available():
        # before the lean region makes its norms lean: a later revert (the
        # CPU DDP wrapper's, mmengine's in one process) would replace them
        segmentor = revert_sync_batchnorm_on_cpu(segmentor)
    select_and_apply(segmentor, settings,
                     settings.input_size or DEFAULT_INPUT_SIZE)
    return segmentor


def patch_means_on(settings: Optional[SettingsLike]) -> bool:
    """Whether ``settings`` apply the patch-mean GELU rule, as the budget
    models."""
    if isinstance(settings, GradientFilterSettings):
        settings = settings.as_dict()
    settings = settings or {}
    return bool(settings.get('lean', DEFAULTS['lean'])
                and settings.get('mode', DEFAULTS['mode']) == 'gf'
                and settings.get('patch_mean_activations',
                                 DEFAULTS['patch_mean_activations']))


def select_and_apply(segmentor: nn.Module, settings: SettingsLike,
                     input_size: Sequence[int],
                     batch: Optional[int] = None,
                     optimizer: Optional[dict] = None) -> list:
    """Choose the layers of ``settings`` (or by its budget) and apply them.

    Returns:
        list[LayerChoice]: the applied layers.
    """
    settings = as_settings(settings)
    num_layers, radius = settings.num_layers, settings.radius
    if settings.budget is not None:
        choice = choose_layers_by_budget(
            segmentor, settings.budget, input_size, batch,
            settings.layer_kinds,
            patch_mean_activations=patch_means_on(settings),
            optimizer=optimizer)
        num_layers, radius = choice.num_layers, choice.radius
    else:
        choice = None
    choices = select_layers(segmentor, num_layers=num_layers,
                            layers=settings.layers, radius=radius,
                            input_size=input_size,
                            layer_kinds=settings.layer_kinds)
    choices = apply_gradient_filter(segmentor, choices, mode=settings.mode,
                                    **settings.surgery_flags())
    state = get_state(segmentor)
    state.reuse_cpu_memory = settings.reuse_cpu_memory
    if (state.lean and state.mode == 'gf'
            and patch_means_on(settings)):
        state.patch_mean_gelus = sorted(
            install_patch_mean_gelus(segmentor, input_size))
    if choice is not None:
        state.budget = choice
    return choices


MODELS.register_module(name='GradFilterModel',
                       module=build_grad_filter_model)


def rewrite_config(cfg):
    """Turn a top-level ``gradient_filter`` setting into the model builder.

    ``cfg.model`` becomes ``dict(type='GradFilterModel', model=<old model>,
    **settings)`` with the settings checked and completed from the config; a
    ``GradFilterHook`` (cost table, frozen norms in eval mode) and ``mmseg_gf``
    in ``custom_imports`` are added so the dumped config builds on its own.
    A config without the setting, or already rewritten with agreeing
    settings, is returned unchanged; a disagreeing one is an error rather
    than a silent choice.

    Args:
        cfg (mmengine.Config): the config, modified in place.

    Returns:
        The same config.

    Raises:
        ValueError: invalid settings (see :func:`check_settings`), or a
            rewritten config whose settings disagree.
    """
    given = cfg.get('gradient_filter')
    if given is None:
        return cfg
    settings = as_settings(given)
    if isinstance(given, GradientFilterSettings):
        cfg.gradient_filter = copy.deepcopy(settings.as_dict())
    if cfg.model.get('type') == 'GradFilterModel':
        _check_rewritten_agrees(settings, cfg.model)
        return cfg
    settings = _completed(settings, cfg)
    cfg.model = dict(type='GradFilterModel', model=cfg.model,
                     **copy.deepcopy(settings.as_dict()))
    add_custom_hook(cfg, 'GradFilterHook')
    add_custom_imports(cfg, 'mmseg_gf')
    return cfg


def _completed(settings: GradientFilterSettings,
               cfg) -> GradientFilterSettings:
    """``settings`` with ``input_size`` and a budget's batch and optimizer
    filled in."""
    changes: Dict[str, Any] = {}
    if settings.input_size is None:
        changes['input_size'] = tuple(default_input_size(cfg))
    budget = settings.budget
    if budget is not None:
        filled = {k: default(cfg) for k, default in (
            ('batch', default_batch_size), ('optimizer', default_optimizer))
            if budget[k] is None}
        changes['budget'] = dict(budget, **filled)
    return replace(settings, **changes)


def _check_rewritten_agrees(settings: GradientFilterSettings,
                            model) -> None:
    """Refuse an existing ``GradFilterModel`` whose settings differ."""
    built = as_settings({k: model[k] for k in SETTING_KEYS if k in model})

    def plain(value):
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return tuple(plain(v) for v in value)
        return value

    differ = []
    for key in SETTING_KEYS:
        given = plain(getattr(settings, key))
        has = plain(getattr(built, key))
        if key == 'input_size' and given is None:
            continue
        if key == 'budget' and given is not None and has is not None:
            # what the rewrite fills in, where gradient_filter has none
            has = dict(has, **{k: None for k in ('batch', 'optimizer')
                               if given.get(k) is None})
        if given != has:
            differ.append(f'{key}: gradient_filter {given!r}, '
                          f'model {has!r}')
    if differ:
        raise ValueError(
            'gradient_filter disagrees with the GradFilterModel the config '
            'already builds (a run\'s dumped config holds both): ' +
            '; '.join(differ) + '. Edit one of them: set model to the plain '
            'segmentor (model.model) and keep gradient_filter, or drop '
            'gradient_filter and edit the model\'s settings.')


def add_custom_hook(cfg, hook_type: str) -> None:
    """Append ``dict(type=hook_type)`` to ``custom_hooks`` unless one is
    there."""
    hooks = list(cfg.get('custom_hooks') or [])
    if not any(h.get('type') == hook_type for h in hooks):
        hooks.append(dict(type=hook_type))
    cfg.custom_hooks = hooks


def add_custom_imports(cfg, *modules: str) -> None:
    """Add ``modules`` to ``cfg.custom_imports`` once each."""
    imports = dict(cfg.get('custom_imports') or {})
    names = list(imports.get('imports', []))
    names += [name for name in modules if name not in names]
    imports['imports'] = names
    imports.setdefault('allow_failed_imports', False)
    cfg.custom_imports = imports
