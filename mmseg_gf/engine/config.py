"""Config support: the ``GradFilterModel`` builder and ``rewrite_config``.

Two equivalent ways to finetune with gradient filtering:

1. A top-level ``gradient_filter = dict(num_layers=5, radius=4)`` (or
   ``dict(budget=dict(saved_mib=300))``, see
   :mod:`mmseg_gf.accounting.budget`) in an mmseg config, turned by :func:`rewrite_config` into
   ``model = dict(type='GradFilterModel', model=<segmentor>, ...)``. The
   builder returns the plain segmentor class with GFConv2d swapped in, so
   checkpoints keep mmseg's keys and load without the plugin.
2. An unchanged config plus ``custom_hooks=[dict(type='GradFilterHook',
   num_layers=5, radius=4)]`` (see ``hooks/grad_filter_hook.py``).
"""
import copy
from typing import Any, Dict, Optional, Sequence

import torch
from mmseg.registry import MODELS
from torch import nn

from ..accounting.budget import check_budget
from ..ops import MAX_RADIUS, check_radius
from .budget import choose_layers_by_budget
from .cpu_distributed import revert_sync_batchnorm_on_cpu
from .patch_mean_activations import install_patch_mean_gelus
from .selection import check_input_size, check_layer_kinds, select_layers
from .state import get_state
from .surgery import apply_gradient_filter, check_mode

__all__ = [
    'SETTING_KEYS', 'check_settings', 'build_grad_filter_model',
    'rewrite_config', 'add_custom_hook', 'add_custom_imports',
    'default_input_size', 'default_batch_size', 'patch_means_on'
]

#: Keys accepted in ``gradient_filter=dict(...)`` and by GradFilterHook.
SETTING_KEYS = ('num_layers', 'layers', 'budget', 'radius', 'mode',
                'train_norm', 'lean', 'input_size', 'keep_frozen_aux_heads',
                'log_frozen_aux_losses', 'reuse_cpu_memory', 'layer_kinds',
                'patch_mean_activations')
#: Settings that are True or False, with their defaults.
FLAG_DEFAULTS = dict(train_norm=False, lean=True, keep_frozen_aux_heads=False,
                     log_frozen_aux_losses=False, reuse_cpu_memory=False,
                     patch_mean_activations=True)
#: The flags the surgery takes (:func:`apply_gradient_filter`); the others
#: act on the process (:mod:`mmseg_gf.engine.cpu_memory`) or on the lean
#: region after it (``patch_mean_activations``:
#: :mod:`mmseg_gf.engine.patch_mean_activations`).
SURGERY_FLAGS = ('train_norm', 'lean', 'keep_frozen_aux_heads',
                 'log_frozen_aux_losses')
DEFAULT_INPUT_SIZE = (512, 512)
DEFAULT_RADIUS = 4


def check_settings(settings: Dict[str, Any]) -> Dict[str, Any]:
    """Validate gradient-filter settings before any model is built.

    Args:
        settings: a dict with keys among :data:`SETTING_KEYS`.

    Returns:
        dict: a copy with defaults filled (radius 4, mode 'gf',
        train_norm False, lean True, keep_frozen_aux_heads False,
        log_frozen_aux_losses False, reuse_cpu_memory False,
        patch_mean_activations True, input_size None, budget None).

    Raises:
        ValueError: not a dict, unknown key, not exactly one of
            num_layers / layers / budget, a budget with a radius (its
            candidates go in ``budget['radii']``), with ``mode`` other than
            'gf' or with ``train_norm``, bad mode, radius, budget or
            input_size. Errors say what is allowed.
    """
    if not isinstance(settings, dict):
        raise ValueError(
            'gradient_filter must be a dict, e.g. dict(num_layers=5, '
            f'radius=4), with keys among {list(SETTING_KEYS)}; got '
            f'{settings!r}')
    unknown = sorted(set(settings) - set(SETTING_KEYS))
    if unknown:
        raise ValueError(f'gradient_filter: unknown key(s) {unknown}; '
                         f'allowed: {list(SETTING_KEYS)}')
    out = dict(radius=None, mode='gf', input_size=None, num_layers=None,
               layers=None, budget=None, layer_kinds=None, **FLAG_DEFAULTS)
    out.update(settings)
    if out['layer_kinds'] is not None:
        out['layer_kinds'] = list(check_layer_kinds(out['layer_kinds']))
    given = [k for k in ('num_layers', 'layers', 'budget')
             if out[k] is not None]
    if len(given) != 1:
        raise ValueError('gradient_filter: give exactly one of num_layers '
                         '(the last N convs), layers (module paths) and '
                         'budget (limits the choice must fit), got '
                         f'num_layers={out["num_layers"]!r}, '
                         f'layers={out["layers"]!r}, '
                         f'budget={out["budget"]!r}')
    if out['budget'] is not None:
        _check_budget_settings(out)
    else:
        _check_layer_settings(out)
        _check_flags(out)
    return out


def _check_budget_settings(out: Dict[str, Any]) -> None:
    """A budget chooses layers and radii itself, for filtered convs with
    frozen norms; then the flags (normalised in place)."""
    out['budget'] = check_budget(out['budget'])
    if out['radius'] is not None:
        raise ValueError(
            'gradient_filter: a budget chooses the radii itself; give '
            'the candidates as budget=dict(..., radii=[2, 4, 8]) instead '
            f'of radius={out["radius"]!r}')
    _check_flags(out)
    if out['mode'] != 'gf' or out['train_norm']:
        raise ValueError(
            "gradient_filter budget needs mode='gf' and "
            'train_norm=False (the costs it fits are those of filtered '
            f'convs with frozen norms), got mode={out["mode"]!r}, '
            f'train_norm={out["train_norm"]!r}')
    if out['budget']['process_mib'] is not None and out['reuse_cpu_memory']:
        raise ValueError(
            'gradient_filter budget process_mib bounds the resident memory, '
            'which reuse_cpu_memory=True lets grow to keep freed memory: '
            'give one of them')


def _check_layer_settings(out: Dict[str, Any]) -> None:
    """num_layers or layers, and radius (normalised in place)."""
    if out['radius'] is None:
        out['radius'] = DEFAULT_RADIUS
    n = out['num_layers']
    if n is not None and (isinstance(n, bool) or not isinstance(n, int)
                          or n < 1):
        raise ValueError(
            f'gradient_filter num_layers must be an int >= 1, got {n!r}')
    if out['layers'] is not None:
        layers = out['layers']
        if isinstance(layers, str):
            layers = [layers]
        if not layers or not all(isinstance(p, str) for p in layers):
            raise ValueError('gradient_filter layers must be a non-empty '
                             f'list of module paths, got {layers!r}')
        out['layers'] = list(layers)
    radius = out['radius']
    values = radius.values() if isinstance(radius, dict) else [radius]
    for r in values:
        if r != 'auto':
            try:
                check_radius(r)
            except ValueError:
                raise ValueError(
                    "gradient_filter radius must be an int >= 1, 'auto' or "
                    'a dict {module path: int or "auto"} (ints at most '
                    f'{MAX_RADIUS}), got {radius!r}') from None


def _check_flags(out: Dict[str, Any]) -> None:
    """mode, the flags and input_size (normalised in place)."""
    check_mode(out['mode'])
    for key in FLAG_DEFAULTS:
        if not isinstance(out[key], bool):
            raise ValueError(f'gradient_filter {key} must be True or False, '
                             f'got {out[key]!r}')
    if out['input_size'] is not None:
        out['input_size'] = check_input_size(out['input_size'])


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


def default_batch_size(cfg) -> Optional[int]:
    """Images per training step from a config (None if it has none)."""
    try:
        return int(cfg.train_dataloader.batch_size)
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def default_optimizer(cfg) -> Optional[dict]:
    """The config's ``optim_wrapper.optimizer`` as a plain dict (None if
    it has none), whose state a budget's peaks count."""
    try:
        optimizer = cfg.optim_wrapper.optimizer
    except (AttributeError, KeyError, TypeError):
        return None
    if not isinstance(optimizer, dict) or 'type' not in optimizer:
        return None
    to_dict = getattr(optimizer, 'to_dict', None)
    return to_dict() if to_dict is not None else dict(optimizer)


def build_grad_filter_model(model: dict,
                            num_layers: Optional[int] = None,
                            layers: Optional[Sequence[str]] = None,
                            budget: Optional[dict] = None,
                            radius: Any = None,
                            mode: str = 'gf',
                            train_norm: bool = False,
                            lean: bool = True,
                            input_size: Optional[Sequence[int]] = None,
                            data_preprocessor: Optional[dict] = None,
                            keep_frozen_aux_heads: bool = False,
                            log_frozen_aux_losses: bool = False,
                            reuse_cpu_memory: bool = False,
                            layer_kinds: Optional[Sequence[str]] = None,
                            patch_mean_activations: bool = True
                            ) -> nn.Module:
    """Build a segmentor and gradient-filter its chosen layers.

    Registered in mmseg's ``MODELS`` as ``GradFilterModel``. Returns the
    segmentor itself (not a wrapper), so its ``state_dict`` keys are plain
    mmseg keys; the choices are kept on it
    (:class:`~mmseg_gf.engine.state.GradientFilterState`), which tells
    GradFilterHook not to apply them again.

    Args:
        model: the segmentor config.
        num_layers, layers, radius, mode, train_norm, lean,
        keep_frozen_aux_heads, log_frozen_aux_losses, layer_kinds: see
            :func:`select_layers` and :func:`apply_gradient_filter`.
        patch_mean_activations: with ``lean`` and ``mode='gf'``, a GELU
            between two filtered layers on one patch partition keeps the
            patch means of its derivative where the traced training step
            shows that exact (:mod:`~.patch_mean_activations`).
        reuse_cpu_memory: kept in the segmentor's state for GradFilterHook,
            which keeps freed CPU memory for reuse when training on CPU
            (:mod:`mmseg_gf.engine.cpu_memory`).
        budget: instead of ``num_layers`` / ``layers`` and ``radius``:
            limits the setting must fit
            (:func:`mmseg_gf.accounting.budget.choose_by_budget`).
        input_size: ``(H, W)`` of the selection trace (default 512).
        data_preprocessor: mmengine's Runner injects the config's top-level
            ``data_preprocessor`` into the model dict; it is forwarded to
            the segmentor config if that has none.
    """
    settings = check_settings(
        dict(num_layers=num_layers, layers=layers, budget=budget,
             radius=radius, mode=mode, train_norm=train_norm, lean=lean,
             input_size=input_size,
             keep_frozen_aux_heads=keep_frozen_aux_heads,
             log_frozen_aux_losses=log_frozen_aux_losses,
             reuse_cpu_memory=reuse_cpu_memory, layer_kinds=layer_kinds,
             patch_mean_activations=patch_mean_activations))
    model = copy.deepcopy(model)
    if data_preprocessor is not None:
        model.setdefault('data_preprocessor', data_preprocessor)
    segmentor = MODELS.build(model)
    if not torch.cuda.is_available():
        # before the lean region makes its norms lean: a later revert (the
        # CPU DDP wrapper's, mmengine's in one process) would replace them
        segmentor = revert_sync_batchnorm_on_cpu(segmentor)
    size = settings['input_size'] or DEFAULT_INPUT_SIZE
    select_and_apply(segmentor, settings, size)
    return segmentor


def patch_means_on(settings: Optional[Dict[str, Any]]) -> bool:
    """Whether a step trained with ``settings`` (a ``gradient_filter``
    dict, checked or not; None: the defaults) applies the patch-mean GELU
    rule (lean, ``mode='gf'``, ``patch_mean_activations``): what the
    budget's profile models too."""
    settings = settings or {}
    return bool(settings.get('lean', FLAG_DEFAULTS['lean'])
                and settings.get('mode', 'gf') == 'gf'
                and settings.get('patch_mean_activations',
                                 FLAG_DEFAULTS['patch_mean_activations']))


def select_and_apply(segmentor: nn.Module, settings: Dict[str, Any],
                     input_size: Sequence[int],
                     batch: Optional[int] = None,
                     optimizer: Optional[dict] = None) -> list:
    """Choose the layers of checked ``settings`` and apply them.

    With a budget, :func:`~mmseg_gf.engine.budget.choose_layers_by_budget`
    decides ``num_layers`` and the radii (its choice is kept in the
    segmentor's state); ``batch`` and ``optimizer`` (an optimizer config)
    are used when the budget names none.

    Returns:
        list[LayerChoice]: the applied layers.
    """
    num_layers, radius = settings['num_layers'], settings['radius']
    if settings['budget'] is not None:
        choice = choose_layers_by_budget(
            segmentor, settings['budget'], input_size, batch,
            settings.get('layer_kinds'),
            patch_mean_activations=patch_means_on(settings),
            optimizer=optimizer)
        num_layers, radius = choice.num_layers, choice.radius
    else:
        choice = None
    choices = select_layers(segmentor, num_layers=num_layers,
                            layers=settings['layers'], radius=radius,
                            input_size=input_size,
                            layer_kinds=settings.get('layer_kinds'))
    choices = apply_gradient_filter(
        segmentor, choices, mode=settings['mode'],
        **{k: settings[k] for k in SURGERY_FLAGS})
    state = get_state(segmentor)
    state.reuse_cpu_memory = settings['reuse_cpu_memory']
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
    **settings)``; a ``GradFilterHook`` with no settings is added to
    ``custom_hooks`` (it logs the cost table and keeps frozen norms in
    eval mode every iteration), and ``mmseg_gf`` to ``custom_imports`` so
    the dumped config builds on its own. A config without
    ``gradient_filter`` is returned unchanged, and so is one already
    rewritten (a run's dumped config holds both the setting and the
    ``GradFilterModel``) when the two agree; when they do not (one was
    edited, e.g. by ``--cfg-options``), it is an error rather than a
    silent choice of one.

    Args:
        cfg (mmengine.Config): the config, modified in place.

    Returns:
        The same config.

    Raises:
        ValueError: invalid settings (see :func:`check_settings`).
    """
    settings = cfg.get('gradient_filter')
    if settings is None:
        return cfg
    settings = check_settings(
        dict(settings) if isinstance(settings, dict) else settings)
    if cfg.model.get('type') == 'GradFilterModel':
        _check_rewritten_agrees(settings, cfg.model)
        return cfg
    if settings['input_size'] is None:
        settings['input_size'] = tuple(default_input_size(cfg))
    if settings['budget'] is not None and settings['budget']['batch'] is None:
        settings['budget'] = dict(settings['budget'],
                                  batch=default_batch_size(cfg))
    if settings['budget'] is not None and \
            settings['budget']['optimizer'] is None:
        settings['budget'] = dict(settings['budget'],
                                  optimizer=default_optimizer(cfg))
    cfg.model = dict(type='GradFilterModel', model=cfg.model, **settings)
    add_custom_hook(cfg, 'GradFilterHook')
    add_custom_imports(cfg, 'mmseg_gf')
    return cfg


def _check_rewritten_agrees(settings: Dict[str, Any], model) -> None:
    """``gradient_filter`` (checked) against the settings of an existing
    ``GradFilterModel``; what the rewrite fills in (``input_size``, a
    budget's ``batch``) counts only where ``gradient_filter`` gives it."""
    built = check_settings({k: model[k] for k in SETTING_KEYS if k in model})

    def plain(value):
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return tuple(plain(v) for v in value)
        return value

    differ = []
    for key in SETTING_KEYS:
        given, has = plain(settings[key]), plain(built[key])
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
    """Append ``dict(type=hook_type)`` to ``cfg.custom_hooks`` unless a hook
    of that type is already there (the user's settings win)."""
    hooks = list(cfg.get('custom_hooks') or [])
    if not any(h.get('type') == hook_type for h in hooks):
        hooks.append(dict(type=hook_type))
    cfg.custom_hooks = hooks


def add_custom_imports(cfg, *modules: str) -> None:
    """Add ``modules`` to ``cfg.custom_imports`` (once each), so that a
    dumped config registers what it uses on its own; failed imports stay
    errors unless the user said otherwise."""
    imports = dict(cfg.get('custom_imports') or {})
    names = list(imports.get('imports', []))
    names += [name for name in modules if name not in names]
    imports['imports'] = names
    imports.setdefault('allow_failed_imports', False)
    cfg.custom_imports = imports
