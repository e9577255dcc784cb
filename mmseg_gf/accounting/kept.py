"""What each kind of module keeps for backward during a training step.

:func:`kept_by_call` turns one traced call (:mod:`.trace`) into what it
keeps per image, so any batch follows; what no rule covers is measured by
the tracer, never counted as zero. The rule table: docs/cost.md, "Kept for
backward, per module kind"."""
import functools
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..models.layer_kinds import kind_of, traced_kind_of
from ..models.lean import frozen_conv_is_lean, is_lean, lean_kind
from ..models.lean_head import (classifier_fused_now, folded_dropout_noise,
                                loss_gradient_copies)
from ..models.segmentor import is_head_classifier
from ..ops.backend import dispatch
from .format import fmt_mib

__all__ = ['CATEGORIES', 'SavedItem', 'StepSavedBytes', 'item_for_module',
           'count_once', 'kept_by_call', 'is_head_lean', 'measured_item',
           'unmodelled_by_kind', 'describe_unmodelled', 'CALL_RULES',
           'register_call_rule', 'CALL_OWNERS', 'register_call_owner',
           'is_call_owner', 'conv_items', 'kind_rule']

#: Categories of :class:`SavedItem`, in table order: ``'conv'`` for convs,
#: ``'linear'`` for Linear projections on tokens (:mod:`.kept_tokens`),
#: ``'classifier'`` for a head's classifier (``conv_seg``, Segmenter's
#: class-score Linears and class masks), ``'attention'`` for what an
#: attention itself keeps (SDPA's q, k, v, output).
CATEGORIES = ('conv', 'linear', 'classifier', 'norm', 'activation',
              'dropout', 'pool', 'logits', 'attention', 'unmodelled')

#: Rules consulted after the module's layer kind's own
#: (:func:`kind_rule`) and before :func:`item_for_module`, each
#: ``rule(path, module, x, out, shared)`` -> a list of items, or None when
#: the module is not its kind (raising ``LookupError`` for one of its kinds
#: that it does not model): modules of no layer kind whose rules live in
#: their own module (:mod:`.kept_transformer`, :mod:`.kept_mask_head`),
#: registered by it.
CALL_RULES: List[Callable] = []


def register_call_rule(rule: Callable) -> Callable:
    """Add ``rule`` to :data:`CALL_RULES` (once); returns it."""
    if rule not in CALL_RULES:
        CALL_RULES.append(rule)
    return rule


#: Predicates ``owner(module) -> bool`` naming modules with children whose
#: own code (not their children's) a rule of :data:`CALL_RULES` counts: the
#: step tracer reports their calls (:mod:`.kept_mask_head`).
CALL_OWNERS: List[Callable[[nn.Module], bool]] = []


def register_call_owner(owner: Callable[[nn.Module], bool]) -> Callable:
    """Add ``owner`` to :data:`CALL_OWNERS` (once); returns it."""
    if owner not in CALL_OWNERS:
        CALL_OWNERS.append(owner)
    return owner


def is_call_owner(module: nn.Module) -> bool:
    """Some registered rule counts ``module``'s own code."""
    return any(owner(module) for owner in CALL_OWNERS)


@dataclass
class SavedItem:
    """What one module keeps, per image (``rule`` scales it to a batch).

    Attributes:
        category: one of :data:`CATEGORIES`.
        elements: elements per image (``'const'``: in all).
        rule: ``'linear'`` (N x elements x bytes), ``'bits'`` (ceil(N x
            elements / 8)) or ``'const'`` (elements x bytes).
        storage: ``data_ptr`` of a tensor the forward already holds, left out
            of the tracer's measurement.
        kind: what an ``'unmodelled'`` item measured (the module's class).
        estimate: only estimated; a measuring trace replaces it."""

    path: str
    category: str
    elements: int
    elem_bytes: int = 4
    rule: str = 'linear'
    storage: Optional[int] = None
    kind: str = ''
    estimate: bool = False

    def nbytes(self, batch: int) -> int:
        if self.rule == 'bits':
            return (batch * self.elements + 7) // 8
        if self.rule == 'const':
            return self.elements * self.elem_bytes
        return batch * self.elements * self.elem_bytes


@dataclass
class StepSavedBytes:
    """What a whole training step keeps for backward, analytically.

    Attributes:
        unmodelled: paths of recorded modules no rule covers.
        input_size: ``(H, W)`` of the trace."""

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

    def unmodelled_bytes(self, batch: int = 1) -> Dict[str, int]:
        """Kind -> bytes at ``batch`` of what no rule covers (measured)."""
        return unmodelled_by_kind(self.items, batch)

    def summary(self, batch: int = 1) -> str:
        """One line for logs and tools: the total and its parts."""
        parts = ', '.join(f'{name} {fmt_mib(v)}' for name, v in
                          self.by_category(batch).items())
        line = (f'kept for backward by the whole step (analytic + measured, '
                f'lean region, batch {batch}): {fmt_mib(self.total(batch))} '
                f'MiB = {parts}')
        unmodelled = self.unmodelled_bytes(batch)
        if unmodelled:
            line += '; ' + describe_unmodelled(unmodelled, batch)
        return line


def unmodelled_by_kind(items: Sequence[SavedItem],
                       batch: int = 1) -> Dict[str, int]:
    """Kind -> bytes at ``batch`` of the ``'unmodelled'`` items, largest
    first."""
    out: Dict[str, int] = {}
    for item in items:
        if item.category == 'unmodelled':
            out[item.kind] = out.get(item.kind, 0) + item.nbytes(batch)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def describe_unmodelled(by_kind: Dict[str, int], batch: int) -> str:
    """``unmodelled: GELU 1.50 MiB measured, ...`` (at ``batch``)."""
    parts = ', '.join(f'{kind} {fmt_mib(v)} MiB measured'
                      for kind, v in by_kind.items())
    return f'unmodelled: {parts}'


def count_once(shared: Dict[int, Tuple[str, Any]], path: str, ptr: int,
               storage: Any = None) -> bool:
    """Claim storage ``ptr`` for ``path``: False when another item counts it
    already. Holding ``storage`` keeps its address from reuse during the
    trace."""
    if ptr in shared:
        return False
    shared[ptr] = (path, storage)
    return True


def measured_item(path: str, kind: str, nbytes: int,
                  constant: bool = False) -> SavedItem:
    """An ``'unmodelled'`` item: ``nbytes`` measured per image (``constant``:
    in all, at any batch, e.g. a view of a Parameter saved by a product)."""
    return SavedItem(path, 'unmodelled', int(nbytes), 1,
                     'const' if constant else 'linear', kind=kind)


def _frozen_conv_item(path: str, conv: nn.Conv2d,
                      x: torch.Tensor) -> Optional[SavedItem]:
    """A frozen conv in the gradient path: nothing when lean, else its
    input (a padded copy of it for other padding modes: not modelled)."""
    if frozen_conv_is_lean(conv) or x.numel() == 0:
        return None
    if conv.padding_mode != 'zeros' or isinstance(conv.padding, str):
        raise LookupError(path)
    return SavedItem(path, 'conv', x[0].numel(), x.element_size(),
                     storage=x.untyped_storage().data_ptr())


def _conv_item(path: str, conv: nn.Conv2d, x: torch.Tensor,
               out: torch.Tensor) -> Optional[SavedItem]:
    if not any(p.requires_grad for p in conv.parameters()):
        return _frozen_conv_item(path, conv, x)
    eb = x.element_size()
    kind = kind_of(conv)
    if kind is not None and kind.is_filtered(conv) and conv.enabled:
        cost = kind.geometry(conv, (x, ), out).cost(
            conv.radius, need_input_grad=False, elem_bytes=eb)
        return SavedItem(path, 'conv', cost.gf_saved_bytes // eb, eb)
    category = 'classifier' if is_head_classifier(path) else 'conv'
    return SavedItem(path, category, x[0].numel(), eb,
                     storage=x.untyped_storage().data_ptr())


def conv_items(path: str, module: nn.Module, x: torch.Tensor,
               out: torch.Tensor, shared: Dict[int, Tuple[str, Any]]
               ) -> List[SavedItem]:
    """The ``conv2d`` kind's kept rule (patch sums, or the input once).

    Raises:
        LookupError: a call it does not model (measured)."""
    item = _conv_item(path, module, x, out)
    if item is not None and item.elements == x[0].numel():
        storage = x.untyped_storage()
        if not count_once(shared, path, storage.data_ptr(), storage):
            return []
    return [] if item is None else [item]


def kind_rule(module: nn.Module) -> Optional[Callable]:
    """The kept rule of ``module``'s layer kind, resolved, or None."""
    kind = traced_kind_of(module)
    rule = None if kind is None else kind.kept_rule
    if isinstance(rule, str):
        rule = _named_rule(rule)
    return rule


@functools.lru_cache(maxsize=64)  # keyed on the layer kinds' rule names
def _named_rule(name: str) -> Callable:
    module, _, function = name.partition(':')
    return getattr(importlib.import_module(module), function)


def item_for_module(path: str, module: nn.Module, x: torch.Tensor,
                    out: torch.Tensor,
                    shared: Dict[int, Tuple[str, Any]]
                    ) -> Optional[SavedItem]:
    """What one recorded leaf module keeps (None: nothing).

    ``shared`` maps storage address -> (path, storage) of what is counted so
    far, so convs sharing an input share it.

    Raises:
        LookupError: no rule covers this module."""
    kind = lean_kind(module) if is_lean(module) else None
    trained = any(p.requires_grad for p in module.parameters())
    if kind == 'frozen_linear' and not trained:
        return None
    if kind == 'norm' and not trained and not module.training:
        # keeps nothing: the factor is recomputed
        if dispatch.choose('frozen_norm', x).implementation.name == 'triton':
            return None
        # float32 scales; float64 ones for a float64 norm (ops.lean)
        wide = module.running_var.dtype == x.dtype == torch.float64
        return SavedItem(path, 'norm', x.shape[1], 8 if wide else 4, 'const')
    if kind == 'activation' and not trained and not (
            getattr(module, 'inplace', False) and x._is_view()):
        # (in place on a view, the plain module runs: measured)
        return SavedItem(path, kind, x[0].numel(), rule='bits')
    if kind == 'dropout' and module.training and module.p != 0:
        return SavedItem(path, kind, x[0].numel(), rule='bits')
    if kind == 'pool' and isinstance(module, nn.AvgPool2d) and x.dim() == 4:
        return None
    if kind == 'pool' and isinstance(module, nn.MaxPool2d):
        if not module.keeps_offsets(x):
            raise LookupError(path)
        return SavedItem(path, 'pool', out[0].numel(), 1)
    if isinstance(module, nn.AdaptiveAvgPool2d) and (kind == 'pool' or
                                                     out.shape[-2:] ==
                                                     (1, 1)):
        return None
    if isinstance(module, nn.Dropout2d) and not trained:
        if not module.training or module.p == 0 or out is x:
            # (its output is its input also when folded into its head's
            # classifier: the fused loss keeps the noise)
            return None
        return SavedItem(path, 'dropout', x.shape[1], x.element_size())
    if isinstance(module, nn.Dropout) and (not module.training
                                           or module.p == 0):
        return None
    raise LookupError(path)


def is_head_lean(model: nn.Module, classifier_path: str) -> bool:
    """Whether the head owning a classifier computes its loss lean."""
    return is_lean(model.get_submodule(classifier_path.rpartition('.')[0]))


def _lean_loss_items(head_path: str, head: nn.Module, conv: nn.Module,
                     x: torch.Tensor, out: torch.Tensor) -> List[SavedItem]:
    """What a lean head's loss keeps for the classifier output ``out``
    (estimates for a head with its own ``loss_by_feat``)."""
    copies = loss_gradient_copies(head) or 1
    eb = out.element_size()
    if not classifier_fused_now(head):
        items = [SavedItem(head_path, 'logits', copies * out[0].numel(), eb)]
        return _mark_estimates(items, head)
    items = []
    if x.requires_grad:
        items.append(SavedItem(head_path, 'logits',
                               copies * out[0].numel(), eb))
        noise = folded_dropout_noise(head)
        if noise is not None:
            items.append(SavedItem(head_path, 'dropout', noise[0].numel(),
                                   noise.element_size()))
    for param in (conv.weight, conv.bias):
        if param is not None and param.requires_grad:
            items.append(SavedItem(head_path, 'classifier',
                                   copies * param.numel(), eb, 'const'))
    return _mark_estimates(items, head)


def _mark_estimates(items: List[SavedItem],
                    head: nn.Module) -> List[SavedItem]:
    if loss_gradient_copies(head) is None:
        for item in items:
            item.estimate = True
    return items


def kept_by_call(model: nn.Module, path: str, module: nn.Module,
                 x: torch.Tensor, out: torch.Tensor,
                 shared: Dict[int, Tuple[str, Any]]
                 ) -> Tuple[List[SavedItem], bool]:
    """Everything one recorded call keeps, a lean head's loss included.

    Returns:
        ``(items, modelled)``; ``modelled`` False: no rule covers the module
        (its bytes unknown, not zero)."""
    head = None
    if is_head_classifier(path) and is_head_lean(model, path):
        head = model.get_submodule(path.rpartition('.')[0])
    if head is not None and classifier_fused_now(head):
        return _lean_loss_items(path.rpartition('.')[0], head, module, x,
                                out), True
    items: List[SavedItem] = []
    modelled = True
    try:
        item = None
        own = kind_rule(module)
        for rule in ([own] if own is not None else []) + CALL_RULES:
            found = rule(path, module, x, out, shared)
            if found is not None:
                items.extend(found)
                break
        else:
            item = item_for_module(path, module, x, out, shared)
    except LookupError:
        item, modelled = None, False
    if item is not None:
        items.append(item)
    if head is not None:
        items.extend(_lean_loss_items(path.rpartition('.')[0], head, module,
                                      x, out))
    return items, modelled
