"""What a Runner run compiles: the segmentor's loss on tensors, not
mmengine's whole ``train_step``.

``train_step`` recompiles every iteration until Dynamo's limit (image
sizes, a float learning rate, new metadata objects), so ``GradFilterHook``
compiles ``loss`` alone on the padded batch with trimmed samples
(docs/lean_region.md); ``compile=dict(target='train_step')`` keeps
mmengine's behaviour.
"""
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..patching import Override, override

__all__ = ['TARGETS', 'LOSS_METAINFO', 'CUDA_GRAPH_MODES', 'split_target',
           'loss_compile_kwargs', 'loss_samples', 'CompiledLoss',
           'install_compiled_loss']

#: What a ``compile`` setting's ``target`` may name: the segmentor's
#: ``loss`` (the default) or mmengine's whole ``train_step``.
TARGETS = ('loss', 'train_step')
#: The metadata a data sample keeps inside the compiled loss: shapes, which
#: mask heads read (``batch_input_shape``, ``pad_shape``); none varies
#: within a batch of mmseg's pipelines with a crop.
LOSS_METAINFO = ('img_shape', 'pad_shape', 'batch_input_shape', 'ori_shape')
#: ``torch.compile`` modes that replay CUDA graphs.
CUDA_GRAPH_MODES = ('reduce-overhead', 'max-autotune')


def split_target(setting: Dict[str, Any]) -> Tuple[str, Dict[str, Any]]:
    """``(target, the rest)`` of a ``compile`` dict.

    Raises:
        ValueError: ``target`` is not one of :data:`TARGETS`.
    """
    rest = dict(setting)
    target = rest.pop('target', 'loss')
    if target not in TARGETS:
        raise ValueError(f'compile target must be one of {list(TARGETS)}, '
                         f'got {target!r}')
    return target, rest


def loss_compile_kwargs(setting: Dict[str, Any]) -> Dict[str, Any]:
    """``torch.compile`` kwargs for the loss: ``dynamic=False`` unless
    named."""
    kwargs = dict(setting)
    kwargs.setdefault('dynamic', False)
    return kwargs


def _canonical(t: torch.Tensor) -> torch.Tensor:
    """``t`` with ``torch.empty``'s strides, size-1 dimensions included (Dynamo
    guards on strides)."""
    t = t.contiguous()
    want = torch.empty(t.shape, device='meta').stride()
    return t if t.stride() == want else t.as_strided(t.shape, want)


def _field(value):
    """A ``PixelData`` with its tensors :func:`_canonical`."""
    if not hasattr(value, 'items') or all(
            not isinstance(v, torch.Tensor) or v.stride() == _canonical(
                v).stride() for _, v in value.items()):
        return value
    new = type(value)(metainfo=value.metainfo)
    for k, v in value.items():
        setattr(new, k, _canonical(v) if isinstance(v, torch.Tensor) else v)
    return new


def loss_samples(data_samples: Optional[Sequence]) -> Optional[List]:
    """``data_samples`` with only ground truths and :data:`LOSS_METAINFO`
    metadata.

    Other metadata would enter Dynamo's guards and recompile every batch.
    """
    if data_samples is None:
        return None
    out = []
    for sample in data_samples:
        meta = {k: sample.metainfo[k] for k in LOSS_METAINFO
                if k in sample.metainfo_keys()}
        new = type(sample)(metainfo=meta)
        new.set_data({k: _field(v) for k, v in sample.items()})
        out.append(new)
    return out


class CompiledLoss:
    """A segmentor's ``loss`` compiled on tensors, fed :func:`loss_samples`."""

    def __init__(self, loss, kwargs: Dict[str, Any]) -> None:
        self.plain = loss
        self.kwargs = dict(kwargs)
        self.compiled = torch.compile(loss, **self.kwargs)
        # Each training step starts a new CUDA graph replay: the previous
        # step's outputs (logged losses) are no longer read.
        self._mark_step = kwargs.get('mode') in CUDA_GRAPH_MODES

    def __call__(self, inputs: torch.Tensor, data_samples=None):
        if self._mark_step:
            torch.compiler.cudagraph_mark_step_begin()
        return self.compiled(inputs, loss_samples(data_samples))


def install_compiled_loss(segmentor: nn.Module,
                          kwargs: Dict[str, Any]) -> Override:
    """Shadow ``segmentor.loss`` with a :class:`CompiledLoss`; returns the
    undo."""
    return override(segmentor, 'loss', CompiledLoss(segmentor.loss, kwargs))
