"""Analytic count of what a lean training step keeps for backward.

The whole step's saved bytes, not only the trained convs' inputs: one trace
of the segmentor's ``loss`` at batch 1 records, for every leaf module that
autograd records (an input that requires a gradient, or a trained
parameter), its kind and shapes; each kind's rule then gives its bytes at
any batch size:

==========================  ===============================================
module                      kept for backward
==========================  ===============================================
trained conv, ``gf``        patch sums of its input, ``N*Ci*cells``
                            elements (:func:`~.cost.conv_backward_cost`)
trained conv, exact         its input ``N*Ci*H*W`` (once per input tensor:
(``vanilla``, classifier)   convs sharing an input share what they keep)
frozen conv                 nothing (its weight is a live Parameter)
lean frozen norm            ``C`` float32 scales
lean ReLU/ReLU6/LeakyReLU   1 bit per element, ``ceil(N*C*H*W / 8)`` bytes
lean element-wise dropout   1 bit per element
adaptive average pooling    nothing (lean: its input's shape; to 1x1 it
                            is a mean, which keeps nothing)
``Dropout2d`` (training)    its noise, one value per channel: ``N*C``
decode head, lean loss      the low-resolution logits ``N*K*h*w``
==========================  ===============================================

Modules of other kinds that autograd records (a trained norm, GELU, ...)
are listed as *unmodelled* with their paths: the count covers the lean
region as :mod:`mmseg_gf.models.lean` defines it. Functional operations
between modules (``torch.cat``, additions, bilinear resizes) keep nothing.
:func:`mmseg_gf.analysis.model_cost.measure_step_memory` measures the same
step, so tests check the two against each other.
"""
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from ..models.gf_conv import GFConv2d
from ..models.lean import is_lean, lean_kind
from .cost import conv_backward_cost

__all__ = ['SavedItem', 'StepSavedBytes', 'trace_step_saved_bytes',
           'item_for_module', 'is_head_lean']

#: Categories of :class:`SavedItem`, in table order.
CATEGORIES = ('conv', 'classifier', 'norm', 'activation', 'dropout',
              'logits')


@dataclass
class SavedItem:
    """What one module keeps, per image (``rule`` scales it to a batch).

    Attributes:
        path: module path.
        category: one of :data:`CATEGORIES`.
        elements: elements per image (``'const'``: in all).
        elem_bytes: bytes per element (``'bits'``: ignored).
        rule: ``'linear'`` (N x elements x bytes), ``'bits'`` (ceil of
            N x elements / 8) or ``'const'`` (elements x bytes).
    """

    path: str
    category: str
    elements: int
    elem_bytes: int = 4
    rule: str = 'linear'

    def nbytes(self, batch: int) -> int:
        if self.rule == 'bits':
            return (batch * self.elements + 7) // 8
        if self.rule == 'const':
            return self.elements * self.elem_bytes
        return batch * self.elements * self.elem_bytes


@dataclass
class StepSavedBytes:
    """The analytic saved bytes of one training step.

    Attributes:
        items: one :class:`SavedItem` per module that keeps something.
        unmodelled: paths of recorded modules no rule covers.
        input_size: ``(H, W)`` of the trace.
    """

    items: List[SavedItem] = field(default_factory=list)
    unmodelled: List[str] = field(default_factory=list)
    input_size: Sequence[int] = (0, 0)

    def total(self, batch: int = 1) -> int:
        """Bytes kept for backward by a step of ``batch`` images."""
        return sum(i.nbytes(batch) for i in self.items)

    def by_category(self, batch: int = 1) -> Dict[str, int]:
        """Category -> bytes at ``batch`` (all categories, zeros kept)."""
        out = {c: 0 for c in CATEGORIES}
        for item in self.items:
            out[item.category] += item.nbytes(batch)
        return out

    def summary(self, batch: int = 1) -> str:
        """One line for logs and tools: the total and its parts."""
        parts = ', '.join(f'{name} {_mib(v)}' for name, v in
                          self.by_category(batch).items())
        line = (f'kept for backward by the whole step (analytic, lean '
                f'region, batch {batch}): {_mib(self.total(batch))} MiB = '
                f'{parts}')
        if self.unmodelled:
            line += (f'; not counted (no lean rule): '
                     f'{", ".join(self.unmodelled[:6])}'
                     f'{" ..." if len(self.unmodelled) > 6 else ""}')
        return line


def _mib(v: int) -> str:
    return f'{v / 2**20:.2f}'


def _is_classifier(path: str) -> bool:
    return path.split('.')[-1] == 'conv_seg'


def _conv_item(path: str, conv: nn.Conv2d, x: torch.Tensor,
               out: torch.Tensor) -> Optional[SavedItem]:
    if not conv.weight.requires_grad:
        return None
    eb = x.element_size()
    if isinstance(conv, GFConv2d) and conv.enabled:
        cost = conv_backward_cost(
            cin=x.shape[1], cout=out.shape[1], kh=conv.kernel_size[0],
            kw=conv.kernel_size[1], stride=conv.stride,
            dilation=conv.dilation, groups=conv.groups, in_hw=x.shape[2:],
            out_hw=out.shape[2:], batch=1, radius=conv.radius,
            need_input_grad=False, elem_bytes=eb)
        return SavedItem(path, 'conv', cost.gf_saved_bytes // eb, eb)
    category = 'classifier' if _is_classifier(path) else 'conv'
    return SavedItem(path, category, x[0].numel(), eb)


def item_for_module(path: str, module: nn.Module, x: torch.Tensor,
                    out: torch.Tensor,
                    shared: Dict[int, str]) -> Optional[SavedItem]:
    """What one recorded leaf module keeps (None: nothing).

    Args:
        path: its module path.
        module: the module, in the state it runs in.
        x, out: its first input and its output.
        shared: storage -> path of the exact convs counted so far (convs
            sharing an input share what they keep); updated.

    Raises:
        LookupError: no rule covers this module.
    """
    if isinstance(module, nn.Conv2d):
        item = _conv_item(path, module, x, out)
        if item is not None and item.elements == x[0].numel():
            # exact convs keep their input tensor itself: once per tensor
            key = x.untyped_storage().data_ptr()
            if key in shared:
                return None
            shared[key] = path
        return item
    kind = lean_kind(module) if is_lean(module) else None
    trained = any(p.requires_grad for p in module.parameters())
    if kind == 'norm' and not trained and not module.training:
        return SavedItem(path, 'norm', x.shape[1], 4, 'const')
    if kind in ('activation', 'dropout') and not (
            kind == 'dropout' and (not module.training or module.p == 0)):
        return SavedItem(path, kind, x[0].numel(), rule='bits')
    if isinstance(module, nn.AdaptiveAvgPool2d) and (kind == 'pool' or
                                                     out.shape[-2:] ==
                                                     (1, 1)):
        return None
    if isinstance(module, nn.Dropout2d) and not trained:
        if not module.training or module.p == 0:
            return None
        return SavedItem(path, 'dropout', x.shape[1], x.element_size())
    if isinstance(module, nn.Dropout) and (not module.training
                                           or module.p == 0):
        return None
    raise LookupError(path)


def trace_step_saved_bytes(model: nn.Module,
                           input_size: Sequence[int]) -> StepSavedBytes:
    """Trace one training forward + loss of ``model`` at batch 1 and count
    what each recorded module keeps (see the module docstring).

    The model is put in training mode with frozen norms in eval mode (as
    training runs); the random state is restored afterwards.
    """
    from ..engine.surgery import set_frozen_norms_eval
    from .model_cost import random_batch
    size = tuple(int(v) for v in input_size)
    result = StepSavedBytes(input_size=size)
    shared: Dict[int, str] = {}
    names = {m: n for n, m in model.named_modules()}
    handles = []

    def record(module, args, output):
        if not args or not isinstance(args[0], torch.Tensor):
            return
        x = args[0]
        recorded = torch.is_grad_enabled() and (
            x.requires_grad
            or any(p.requires_grad for p in module.parameters()))
        if not recorded:
            return
        path = names[module]
        if lean_kind(module) == 'loss' or not isinstance(
                output, torch.Tensor):
            return
        try:
            item = item_for_module(path, module, x, output, shared)
        except LookupError:
            result.unmodelled.append(path)
            return
        if item is not None:
            result.items.append(item)
        if _is_classifier(path) and is_head_lean(model, path):
            result.items.append(
                SavedItem(path.rpartition('.')[0], 'logits',
                          output[0].numel(), output.element_size()))

    for module in model.modules():
        if not any(True for _ in module.children()):
            handles.append(module.register_forward_hook(record))
    was_training = model.training
    try:
        with torch.random.fork_rng():
            model.train()
            set_frozen_norms_eval(model)
            inputs, samples = random_batch(model, size, 1)
            model.loss(inputs, samples)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return result


def is_head_lean(model: nn.Module, classifier_path: str) -> bool:
    """Whether the head owning a classifier computes its loss lean (it
    then keeps its low-resolution logits for backward)."""
    return is_lean(model.get_submodule(classifier_path.rpartition('.')[0]))
