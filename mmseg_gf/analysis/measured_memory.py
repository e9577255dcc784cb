"""Measured memory of a config's training step, GF vs vanilla.

``tools/analyze_cost.py --measure`` prints it: what autograd really keeps
per trained conv next to the cost model's count of the same conv, and the
step's peak, for the same layers trained with the filtered and the exact
backward.
"""
import copy
from dataclasses import replace
from typing import Any, Dict, Optional, Sequence

import torch

from ..accounting.batch import random_batch, training_loss
from ..accounting.measured import profiled_peak_bytes, saved_bytes_by_module
from ..engine.build import build_segmentor
from ..engine.config import config_settings
from ..engine.settings import GradientFilterSettings
from ..engine.surgery import get_gradient_filter_layers
from .model_cost import model_backward_cost

__all__ = ['measure_memory']


def measure_memory(cfg,
                   input_size: Sequence[int] = (64, 64),
                   batch: int = 1,
                   device: str = 'cpu',
                   modes: Sequence[str] = ('vanilla', 'gf'),
                   num_layers: Optional[int] = None,
                   radius: Any = 4) -> Dict[str, Any]:
    """Measure what the trained part keeps for backward, GF vs vanilla.

    Per mode, one training step of the config's segmentor: per trained conv
    the storages autograd packs (Parameters left out) next to the analytic
    count, the forward's total saved bytes, and the step's peak.

    Args:
        cfg (mmengine.Config): not modified.
        input_size: ``(H, W)`` of the random batch (small is fine).
        batch: images per step.
        device: ``'cpu'`` or ``'cuda'``.
        modes: which of ``'vanilla'`` / ``'gf'`` to measure.
        num_layers, radius: the setting for a config without
            ``gradient_filter`` (then ``num_layers`` is required).

    Returns:
        dict ``{mode: {'layers': [{path, measured, analytic}],
        'trained_saved_bytes', 'analytic_saved_bytes', 'saved_bytes_total',
        'peak_bytes'}}`` plus ``input_size``, ``batch``, ``device``.
    """
    settings = config_settings(cfg)
    if settings is None:
        if num_layers is None:
            raise ValueError(
                'measure_memory: the config has no gradient_filter setting; '
                'give num_layers (the last N convs to train)')
        settings = GradientFilterSettings(num_layers=num_layers,
                                          radius=radius)
    size = tuple(int(v) for v in input_size)
    out: Dict[str, Any] = dict(input_size=list(size), batch=int(batch),
                               device=str(device))
    for mode in modes:
        run_cfg = copy.deepcopy(cfg)
        run_cfg.gradient_filter = replace(settings, mode=mode)
        out[mode] = _measure_mode(run_cfg, mode, size, batch, device)
    return out


def _measure_mode(cfg, mode: str, size, batch: int,
                  device: str) -> Dict[str, Any]:
    """One mode's measured and analytic saved bytes, and its peak."""
    torch.manual_seed(0)
    model = build_segmentor(cfg, input_size=size).to(device)
    cost = model_backward_cost(model, size, batch=batch)
    convs = {c.path: c.module for c in get_gradient_filter_layers(model)}
    inputs, samples = random_batch(model, size, batch, device)

    def forward():
        return training_loss(model, inputs, samples)

    def step():
        forward().backward()
        # Released at the step's end, as mmengine's OptimWrapper does: the
        # next step starts without gradients and its peak holds all it
        # allocates (freeing the previous ones inside the measured step
        # would offset its peak by their bytes, down to 0 on a small map).
        model.zero_grad(set_to_none=True)

    per_layer, total = saved_bytes_by_module(
        forward, convs, exclude=list(model.parameters()))
    model.zero_grad(set_to_none=True)
    step()  # warm-up (lazy allocations, kernel choice)
    peak = profiled_peak_bytes(step, torch.device(device))
    layers = []
    for layer in cost.layers:
        analytic = (layer.cost.gf_saved_bytes if mode == 'gf' else
                    layer.cost.vanilla_saved_bytes)
        layers.append(dict(path=layer.path, radius=layer.radius,
                           measured=per_layer[layer.path],
                           analytic=analytic))
    return dict(layers=layers,
                trained_saved_bytes=sum(x['measured'] for x in layers),
                analytic_saved_bytes=sum(x['analytic'] for x in layers),
                saved_bytes_total=total, peak_bytes=peak)
