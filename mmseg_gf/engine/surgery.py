"""Swap selected layers for their kind's filtered module and freeze the rest.

The swap shares Parameters, so ``state_dict`` keys and values are unchanged
and an optimizer built before it stays valid.
"""
import logging
from typing import List, Optional, Sequence

from mmengine.logging import print_log
from torch import nn

from ..models.layer_kinds import kind_of, layer_kinds, traced_kind_of
from ..models.segmentor import (classifier_paths, set_frozen_norms_eval,
                                unwrap_model)
from .frozen_aux_heads import skip_frozen_aux_heads
from .lean_region import apply_lean_region
from .selection import LayerChoice, radius_over_map
from .state import GradientFilterState, get_state, set_state

__all__ = ['MODES', 'check_mode', 'apply_gradient_filter',
           'get_gradient_filter_layers']

#: 'gf': filtered backward; 'vanilla': same layers trained, exact backward
#: (the paper's "Vanilla BP N" baseline differs from "Ours N" only here).
MODES = ('gf', 'vanilla')


def check_mode(mode: str) -> str:
    """Validate ``mode``; raises ValueError naming the allowed values."""
    if mode not in MODES:
        raise ValueError(f'gradient_filter mode must be one of {MODES}, '
                         f'got {mode!r}')
    return mode


def get_gradient_filter_layers(
        model: nn.Module) -> Optional[List[LayerChoice]]:
    """The layers applied to ``model`` (wrapped or not), or None."""
    state = get_state(model)
    return None if state is None else state.layers


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition('.')
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, name, module)


def apply_gradient_filter(model: nn.Module,
                          choices: Sequence[LayerChoice],
                          mode: str = 'gf',
                          train_norm: bool = False,
                          lean: bool = True,
                          keep_frozen_aux_heads: bool = False,
                          log_frozen_aux_losses: bool = False
                          ) -> List[LayerChoice]:
    """Swap the chosen layers to their kind's filtered module and freeze all
    other parameters.

    Trainable afterwards: the chosen layers, the classifiers and, with
    ``train_norm``, the norm after each chosen layer. Freezing makes the
    backward cheap: autograd stops at the first chosen layer and frozen layers
    save nothing. Idempotent: a model already marked is returned unchanged.

    Args:
        model: the segmentor (unwrapped, or a wrapper with ``.module``).
        choices: from :func:`select_layers` on this model.
        mode: ``'gf'`` or ``'vanilla'`` (exact backward, same layers).
        train_norm: also train the norms following the chosen layers.
        lean: frozen norms, activations, dropout and the loss keep only what
            their backward needs (:mod:`mmseg_gf.engine.lean_region`); same
            forward, same gradients.
        keep_frozen_aux_heads: run frozen auxiliary heads as mmseg does;
            False leaves them out (:mod:`mmseg_gf.engine.frozen_aux_heads`).
        log_frozen_aux_losses: still log the left-out heads' losses.

    Returns:
        list[LayerChoice]: the choices, ``module`` now the filtered one.
    """
    check_mode(mode)
    model = unwrap_model(model)
    if get_state(model) is not None:
        return get_state(model).layers
    if not choices:
        raise ValueError('gradient_filter: no layer selected')
    if mode == 'gf':
        warn_radius_over_map(choices)
    _swap_chosen_layers(model, choices, enabled=mode == 'gf')
    _freeze_all_but(model, choices, train_norm)
    set_state(model, GradientFilterState(
        list(choices), mode, bool(lean),
        keep_frozen_aux_heads=bool(keep_frozen_aux_heads),
        log_frozen_aux_losses=bool(log_frozen_aux_losses)))
    if not keep_frozen_aux_heads:
        skip_frozen_aux_heads(model)
    if lean:
        apply_lean_region(model)
    set_frozen_norms_eval(model)
    return list(choices)


def warn_radius_over_map(choices: Sequence[LayerChoice]) -> None:
    """Warn for each chosen layer whose radius exceeds its output map."""
    for choice in choices:
        reason = radius_over_map(choice)
        if reason is not None:
            print_log(reason, logger='current', level=logging.WARNING)


def _swap_chosen_layers(model: nn.Module, choices: Sequence[LayerChoice],
                        enabled: bool) -> None:
    """Install what the chosen kinds read per step, then swap each chosen
    layer."""
    chosen_kinds = {c.kind for c in choices}
    for kind in layer_kinds():
        # what the kinds' filtered modules read in every step (the Linear
        # kinds: the hooks keeping their token grids current)
        if kind.install is not None and kind.name in chosen_kinds:
            kind.install(model)
    for choice in choices:
        layer = model.get_submodule(choice.path)
        # a traced layer no kind can filter: its kind's from_plain says why
        kind = kind_of(layer) or traced_kind_of(layer)
        if kind is None:
            raise TypeError(
                f'gradient_filter: {choice.path!r} is a '
                f'{type(layer).__name__}, which no layer kind can filter')
        filtered = kind.set_filter(layer, choice.radius, enabled)
        if filtered is not layer:
            _set_submodule(model, choice.path, filtered)
        choice.module = filtered


def _freeze_all_but(model: nn.Module, choices: Sequence[LayerChoice],
                    train_norm: bool) -> None:
    """Freeze every parameter but the chosen layers, classifiers and
    (``train_norm``) norms."""
    for p in model.parameters():
        p.requires_grad_(False)
    trained = [c.path for c in choices] + classifier_paths(model)
    if train_norm:
        trained += [c.norm_path for c in choices if c.norm_path]
    for path in trained:
        for p in model.get_submodule(path).parameters():
            p.requires_grad_(True)
