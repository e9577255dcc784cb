"""The selection trace: which filterable layers a segmentor runs, in which
order, and which of them a loss gradient reaches.

"The last N layers" means forward execution order on the inference path,
not registration order (mmseg heads register ``conv_seg`` first). The
segmentor runs once through ``encode_decode`` with forward hooks on every
layer of a registered kind, then its auxiliary heads, marked; a layer
feeds the output when its autograd node is behind the logits, so layers
run under ``no_grad`` or detached drop out by themselves. The policy on
the records is :mod:`.selection`.
"""
import contextlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..models.layer_kinds import CONV2D, layer_kinds, traced_kind_of
from ..models.segmentor import NORM_TYPES, unwrap_model
from ..patching import Hooks, override

__all__ = ['LayerRecord', 'trace_layers', 'nested_tensors', 'head_list']


@dataclass
class LayerRecord:
    """A layer of a registered kind seen during the trace (first call only).

    Attributes:
        inference: it ran on the inference path (False: an auxiliary head).
        input_requires_grad: its input needed a gradient (``grad=True`` only).
        norm_path: the norm consuming its output right after it, if any.
        feeds_output: a loss gradient on the output reaches it (None for
            ``grad=True``).
        feeds_heads: some head output depends on it (None for ``grad=True``).
    """

    path: str
    module: nn.Module
    in_shape: Tuple[int, int, int]
    out_shape: Tuple[int, int, int]
    inference: bool = True
    norm_path: Optional[str] = None
    input_requires_grad: bool = False
    feeds_output: Optional[bool] = None
    feeds_heads: Optional[bool] = None
    kind: str = CONV2D.name
    geometry: Any = None


def nested_tensors(obj) -> List[torch.Tensor]:
    """The tensors in a (nested) head output: tensor, list, tuple, dict."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in nested_tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in nested_tensors(o)]
    return []


def _capture(obj: nn.Module, name: str, sink: List) -> callable:
    """Record every result of ``obj.<name>``, even when called directly;
    returns the undo."""
    original = getattr(obj, name)

    def method(*args, **kwargs):
        out = original(*args, **kwargs)
        sink.append(out)
        return out

    return override(obj, name, method)


def head_list(head) -> List[nn.Module]:
    """A segmentor's head(s) as a list."""
    if head is None:
        return []
    return list(head) if isinstance(head, nn.ModuleList) else [head]


def _run_inference_path(model: nn.Module, x: torch.Tensor,
                        aux_marker: List[bool]):
    """mmseg's ``encode_decode``, then the auxiliary heads on its features.

    Returns:
        ``(output, side_outputs)``: the logits and the auxiliary outputs.
    """
    h, w = x.shape[-2:]
    feats: List = []
    if hasattr(model, 'encode_decode'):
        metas = [dict(img_shape=(h, w), pad_shape=(h, w), ori_shape=(h, w))]
        restore = _capture(model, 'extract_feat', feats)
        try:
            out = model.encode_decode(x, metas)
        finally:
            restore()
    else:
        feats.append(model.extract_feat(x))
        heads = head_list(model.decode_head)
        out = heads[0].forward(feats[0])
        for head in heads[1:]:
            out = head.forward(feats[0], out)
    side = []
    aux = head_list(getattr(model, 'auxiliary_head', None))
    if aux:
        aux_marker[0] = True
        x_aux = feats[0] if feats else model.extract_feat(x)
        for head in aux:
            side.append(head.forward(x_aux))
    return out, side


def _graph_nodes(roots: Sequence[torch.Tensor], seen: set) -> set:
    """Add to ``seen`` every autograd node behind ``roots``."""
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(n for n, _ in node.next_functions)
    return seen


def _drop_saved(tensor):
    return None


def _no_unpack(_):
    raise RuntimeError('the selection trace keeps no activation for '
                       'backward')


def trace_layers(model: nn.Module,
                input_size: Sequence[int] = (512, 512),
                grad: bool = False) -> List[LayerRecord]:
    """Run the segmentor once and list its layers of a registered kind in
    execution order.

    Eval mode, no activation kept; the trace changes no state.

    Args:
        model: an ``EncoderDecoder`` or ``CascadeEncoderDecoder``.
        input_size: ``(H, W)`` of the dummy input (use the training crop).
        grad: False: every parameter requires a gradient, to find
            ``feeds_output`` / ``feeds_heads``. True: parameters keep their
            own, to find ``input_requires_grad`` after surgery.

    Returns:
        One :class:`LayerRecord` per layer that ran, first-call order,
        inference-path layers first.
    """
    model = unwrap_model(model)
    if not (hasattr(model, 'extract_feat') and hasattr(model, 'decode_head')):
        raise ValueError(
            'gradient filter layer selection needs an mmseg segmentor with '
            f'extract_feat and decode_head, got {type(model).__name__}')
    hooks = _LayerHooks(model, grad)
    head_outputs: List = []
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device('cpu')
    dtype = param.dtype if param is not None and \
        param.dtype.is_floating_point else torch.float32
    h, w = (int(v) for v in input_size)
    with hooks.installed(), _captured_heads(model, head_outputs), \
            _trace_state(model, grad), torch.enable_grad(), \
            torch.autograd.graph.saved_tensors_hooks(_drop_saved,
                                                     _no_unpack):
        out, side = _run_inference_path(
            model, torch.zeros(1, 3, h, w, device=device, dtype=dtype),
            hooks.aux_marker)
    if not grad:
        behind_output = _graph_nodes(nested_tensors(out), set())
        behind_heads = _graph_nodes(
            nested_tensors(head_outputs) + nested_tensors(side),
            set(behind_output))
        for module, rec in hooks.records.items():
            calls = hooks.nodes.get(module, [])
            rec.feeds_output = any(n in behind_output for n in calls)
            rec.feeds_heads = any(n in behind_heads for n in calls)
    return list(hooks.records.values())


class _LayerHooks:
    """Forward hooks of the selection trace: records, autograd nodes and
    norms."""

    def __init__(self, model: nn.Module, grad: bool) -> None:
        self.model = model
        self.grad = grad
        self.names = {m: n for n, m in model.named_modules()}
        self.records: Dict[nn.Module, LayerRecord] = {}
        self.nodes: Dict[nn.Module, list] = {}
        self.aux_marker = [False]
        self.last_layer: Optional[Tuple[LayerRecord, torch.Tensor]] = None

    def layer_hook(self, module, inputs, kwargs, output) -> None:
        if not inputs:  # called with keywords (mmcv's attention wrapper)
            inputs = tuple(v for v in kwargs.values()
                           if isinstance(v, torch.Tensor))
        if isinstance(output, tuple) and output and \
                isinstance(output[0], torch.Tensor):
            output = output[0]  # nn.MultiheadAttention: (out, weights)
        if isinstance(output, torch.Tensor) and output.grad_fn is not None:
            self.nodes.setdefault(module, []).append(output.grad_fn)
        if module in self.records or not isinstance(output, torch.Tensor) \
                or not inputs:
            self.last_layer = None
            return
        kind = traced_kind_of(module)
        geometry = kind.geometry(module, inputs, output)
        rec = LayerRecord(self.names[module], module,
                          tuple(geometry.in_shape),
                          tuple(geometry.out_shape),
                          not self.aux_marker[0],
                          input_requires_grad=bool(self.grad)
                          and inputs[0].requires_grad,
                          kind=kind.name, geometry=geometry)
        self.records[module] = rec
        self.last_layer = (rec, output)

    def norm_hook(self, module, inputs, output) -> None:
        # A norm "directly follows" a layer when it consumes that very
        # tensor.
        last = self.last_layer
        if last is not None and inputs and inputs[0] is last[1] and \
                last[0].norm_path is None:
            last[0].norm_path = self.names[module]
        self.last_layer = None

    @contextlib.contextmanager
    def installed(self):
        hooks = Hooks()
        traced = tuple(k.traced_type for k in layer_kinds())
        for m in self.model.modules():
            if isinstance(m, traced):
                hooks.add(m.register_forward_hook(self.layer_hook,
                                                  with_kwargs=True))
            elif isinstance(m, NORM_TYPES):
                hooks.add(m.register_forward_hook(self.norm_hook))
        undos = [k.prepare(self.model) for k in layer_kinds()
                 if k.prepare is not None]
        try:
            yield self
        finally:
            hooks.remove()
            for undo in undos:
                if undo is not None:
                    undo()


@contextlib.contextmanager
def _captured_heads(model: nn.Module, sink: List):
    """Every decode head's ``forward`` results go to ``sink``."""
    restores = [_capture(head, 'forward', sink)
                for head in head_list(model.decode_head)]
    try:
        yield sink
    finally:
        for restore in restores:
            restore()


@contextlib.contextmanager
def _trace_state(model: nn.Module, grad: bool):
    """Eval mode, checkpointing off and (``grad=False``) all parameters
    trainable; restored after."""
    modes = {m: m.training for m in model.modules()}
    checkpointed = [
        m for m in model.modules() if getattr(m, 'with_cp', False) is True
    ]
    flags = {p: p.requires_grad for p in model.parameters()}
    try:
        model.eval()
        for m in checkpointed:
            m.with_cp = False
        if not grad:
            for p in flags:
                p.requires_grad_(True)
        yield
    finally:
        for m, mode in modes.items():
            m.training = mode
        for m in checkpointed:
            m.with_cp = True
        for p, flag in flags.items():
            p.requires_grad_(flag)
