"""A budget's choice on a real segmentor: the probe the accounting profiles.

The probe is a copy of the segmentor with every ``num_layers`` candidate
trained (exact backward, lean region on); :mod:`mmseg_gf.accounting`
costs every setting from one traced step of it.
"""
import copy
import gc
from typing import Any, Dict, Optional, Sequence

import torch
from torch import nn

from ..accounting.budget import (PEAK_KEYS, BudgetChoice, check_budget,
                                 choose_by_budget)
from ..accounting.optimizer_state import optimizer_state_ratio
from ..accounting.step_profile import StepCostProfile, profile_step_costs
from ..models.segmentor import is_classifier, unwrap_model
from .cpu_memory import bound_process_memory
from .frozen_aux_heads import unlogged_aux_heads
from .layer_trace import trace_layers
from .selection import check_layer_kinds, has_grid, select_layers
from .surgery import apply_gradient_filter
from .train_log import resident_bytes

__all__ = ['profile_segmentor', 'choose_layers_by_budget',
           'process_base_bytes']


def profile_segmentor(model: nn.Module, input_size: Sequence[int],
                      timeline: bool = False,
                      layer_kinds: Optional[Sequence[str]] = None,
                      patch_mean_activations: bool = True
                      ) -> StepCostProfile:
    """Profile a copy of a plain segmentor for the costs of every last-N
    setting.

    Args:
        model: an mmseg segmentor (not changed).
        input_size: ``(H, W)`` (the training crop).
        timeline: also profile live bytes per call, for the step peak.
        layer_kinds: the kinds of the pool; default: every kind.
        patch_mean_activations: count a GELU between filtered layers by its
            derivative's patch means, as the trained model would.
    """
    model = unwrap_model(model)
    size = (int(input_size[0]), int(input_size[1]))
    kinds = check_layer_kinds(layer_kinds)
    # what num_layers counts (layers on no token grid are not)
    pool = [r for r in trace_layers(model, size) if r.inference
            and not is_classifier(r.path) and r.feeds_output
            and r.kind in kinds and has_grid(r)]
    if not pool:
        raise ValueError(
            f'gradient_filter budget: {type(model).__name__} runs no conv '
            'that the output depends on besides its classifier')
    probe = copy.deepcopy(model)
    choices = select_layers(probe, num_layers=len(pool), radius=1,
                            input_size=size, layer_kinds=kinds)
    apply_gradient_filter(probe, choices, mode='vanilla', lean=True)
    # its auxiliary heads are left out as the trained model's are; the
    # trained model logs that, not the probe
    with unlogged_aux_heads(probe):
        return profile_step_costs(
            probe, [c.module for c in choices], size, is_classifier,
            timeline=timeline,
            patch_mean_activations=patch_mean_activations)


def choose_layers_by_budget(segmentor: nn.Module, budget: Dict[str, Any],
                            input_size: Sequence[int],
                            batch: Optional[int] = None,
                            layer_kinds: Optional[Sequence[str]] = None,
                            patch_mean_activations: bool = True,
                            optimizer: Optional[dict] = None
                            ) -> BudgetChoice:
    """Profile ``segmentor`` and choose the setting that fits ``budget``.

    Args:
        segmentor: the plain segmentor.
        budget: see :func:`~mmseg_gf.accounting.budget.check_budget`.
        input_size: the training crop.
        batch: images per step, unless the budget names it.
        layer_kinds: the kinds the budget chooses among.
        patch_mean_activations: as :func:`profile_segmentor`.
        optimizer: the optimizer config whose state the peaks count, unless
            the budget names one.
    """
    budget = check_budget(budget)
    batch = budget['batch'] or batch or 1
    on_cpu = not torch.cuda.is_available()
    if budget['process_mib'] is not None and on_cpu:
        bound_process_memory()
    profile = profile_segmentor(segmentor, input_size,
                                timeline=any(budget[k] is not None
                                             for k in PEAK_KEYS),
                                layer_kinds=layer_kinds,
                                patch_mean_activations=patch_mean_activations)
    profile.optimizer_state_ratio = optimizer_state_ratio(
        budget['optimizer'] or optimizer)
    profile.process_base_bytes = process_base_bytes(segmentor)
    choice = choose_by_budget(profile, budget, batch)
    del profile
    gc.collect()  # the probe (its hooks make cycles) goes now
    return choice


def process_base_bytes(segmentor: nn.Module) -> Optional[int]:
    """What the process holds besides a step, for a ``process_mib`` limit.

    CUDA: the model's parameters and buffers; CPU: ``VmRSS`` less the probe's
    (docs/budget.md). None where it cannot be read.
    """
    model = unwrap_model(segmentor)
    tensors = sum(t.numel() * t.element_size() for t in
                  list(model.parameters()) + list(model.buffers()))
    if torch.cuda.is_available():
        return tensors
    resident = resident_bytes()
    return None if resident is None else resident - tensors
