"""How close a model's filtered gradients are to the exact ones, per layer
(``tools/gradient_quality.py``; paper Sections 4.1, 5.6).

Local quality of every filtered layer from a whole segmentor's backward,
and the end-to-end weight-gradient error
(docs/gradient_filter.md#gradient-quality).
"""
import copy
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..accounting.batch import random_batch, training_loss
from ..accounting.format import format_table
from ..engine.build import build_segmentor
from ..engine.surgery import get_gradient_filter_layers
from ..models.layer_kinds import kind_of
from ..models.gradient_quality import capture_layer_io, cosine, snr

__all__ = [
    'dataset_batch', 'measure_model_quality', 'measure_config_quality',
    'quality_table', 'QUALITY_COLUMNS', 'jsonable_rows'
]


def dataset_batch(cfg, model: nn.Module, batch: int, device):
    """The first ``batch`` train samples, preprocessed:
    ``(inputs, data_samples)``."""
    from mmengine.dataset import pseudo_collate
    from mmseg.registry import DATASETS
    dataset = DATASETS.build(cfg.train_dataloader.dataset)
    data = pseudo_collate([dataset[i] for i in range(batch)])
    model.to(device)
    data = model.data_preprocessor(data, training=True)
    return data['inputs'], data['data_samples']


def _set_enabled(convs: List[Tuple[str, nn.Module]], enabled: bool) -> None:
    for _, conv in convs:
        conv.enabled = enabled


def _backward(model, inputs, samples, convs, seed, record: bool):
    """One forward + backward; the convs' weight grads and, if ``record``,
    ``(x, g_y)``."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks in every pass
    records: Dict[str, Any] = {}
    if record:
        with capture_layer_io(convs) as records:
            training_loss(model, inputs, samples).backward()
    else:
        training_loss(model, inputs, samples).backward()
    grads = {name: conv.weight.grad.detach().clone()
             for name, conv in convs if conv.weight.grad is not None}
    return grads, dict(records)


def measure_model_quality(model: nn.Module, inputs, samples,
                          upstream: str = 'exact',
                          seed: int = 0) -> List[Dict[str, Any]]:
    """Per filtered layer: local and end-to-end quality.

    Args:
        model: a segmentor with gradient filtering applied.
        inputs, samples: one preprocessed batch.
        upstream: ``'exact'`` or ``'filtered'``: which backward gives each
            layer's ``x`` and ``g_y``.
        seed: torch seed before each pass (same dropout masks).

    Returns:
        One dict per layer: ``path``, ``radius``, the
        :class:`~.quality.GradientQuality` fields, ``proposition1_holds``,
        ``e2e_snr_grad_weight``, ``e2e_cos_grad_weight``.
    """
    choices = get_gradient_filter_layers(model)
    if not choices:
        raise ValueError('the model has no gradient-filtered layers; give '
                         'a config with a gradient_filter setting')
    convs = [(c.path, c.module) for c in choices]
    was = {name: conv.enabled for name, conv in convs}
    try:
        _set_enabled(convs, False)
        exact_w, exact_io = _backward(model, inputs, samples, convs, seed,
                                      record=upstream == 'exact')
        _set_enabled(convs, True)
        gf_w, gf_io = _backward(model, inputs, samples, convs, seed,
                                record=upstream == 'filtered')
    finally:
        for name, conv in convs:
            conv.enabled = was[name]
        model.zero_grad(set_to_none=True)
    records = exact_io if upstream == 'exact' else gf_io
    rows = []
    for choice in choices:
        name, conv = choice.path, choice.module
        x, grad_out = records.get(name, (None, None))
        row: Dict[str, Any] = dict(path=name, radius=choice.radius)
        if x is not None and grad_out is not None:
            conv64 = copy.deepcopy(conv).double()
            q = kind_of(conv64).quality(conv64, x.double(),
                                        grad_out.double(), choice.radius)
            row.update(vars(q))
            row['proposition1_holds'] = q.proposition1_holds
        if name in exact_w and name in gf_w:
            row['e2e_snr_grad_weight'] = snr(exact_w[name], gf_w[name])
            row['e2e_cos_grad_weight'] = cosine(exact_w[name], gf_w[name])
        rows.append(row)
    return rows


def measure_config_quality(cfg, checkpoint: Optional[str] = None,
                           source: str = 'random',
                           shape: Sequence[int] = (512, 512),
                           batch: int = 2, label_block: int = 16,
                           seed: int = 0, upstream: str = 'exact',
                           device: str = 'cpu'):
    """Build a config's filtered segmentor, load weights, measure one batch.

    Args:
        cfg (mmengine.Config): with a ``gradient_filter`` setting.
        checkpoint: weights to load (default: initialisation).
        source: ``'random'`` or ``'dataset'`` (the first train samples).

    Returns:
        ``(rows, input_shape)``: the per-layer rows and the batch's shape.
    """
    shape = tuple(shape)
    torch.manual_seed(seed)
    model = build_segmentor(
        cfg, input_size=shape if source == 'random' else None)
    if checkpoint:
        from mmengine.runner import load_checkpoint
        load_checkpoint(model, checkpoint, map_location='cpu')
    model.to(device)
    if source == 'dataset':
        inputs, samples = dataset_batch(cfg, model, batch, device)
    else:
        inputs, samples = random_batch(model, shape, batch, device,
                                       seed=seed, label_block=label_block)
    rows = measure_model_quality(model, inputs, samples, upstream, seed)
    return rows, list(inputs.shape)


def _fmt(v) -> str:
    if v is None:
        return '-'
    if isinstance(v, bool):
        return 'yes' if v else 'no'
    if isinstance(v, float):
        if math.isinf(v):
            return 'inf'
        if math.isnan(v):
            return 'nan'
        return f'{v:.4g}'
    return str(v)


#: The columns of :func:`quality_table`: (row key, column title).
QUALITY_COLUMNS = (
    ('path', 'layer'), ('radius', 'r'), ('snr_grad_output', 'SNR g_y'),
    ('snr_grad_input_propagated', 'SNR g_x (Prop. 1)'),
    ('snr_grad_input', 'SNR g_x (GF)'), ('snr_grad_weight', 'SNR g_W'),
    ('cos_grad_output', 'cos g_y'), ('cos_grad_input', 'cos g_x'),
    ('cos_grad_weight', 'cos g_W'),
    ('proposition1_holds', 'Prop. 1 holds'),
    ('e2e_snr_grad_weight', 'SNR g_W e2e'),
    ('e2e_cos_grad_weight', 'cos g_W e2e'))


def quality_table(rows: List[Dict[str, Any]]) -> str:
    """:func:`measure_model_quality`'s rows as a markdown table."""
    return format_table([label for _, label in QUALITY_COLUMNS],
                        [[_fmt(row.get(key)) for key, _ in QUALITY_COLUMNS]
                         for row in rows])


def jsonable_rows(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The rows with infinite / NaN floats as strings (json has no
    infinity)."""

    def value(v):
        if isinstance(v, float) and (math.isinf(v) or math.isnan(v)):
            return str(v)
        return v

    return [{k: value(v) for k, v in r.items()} for r in rows]
