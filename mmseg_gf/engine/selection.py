"""Which convolutions to gradient-filter, and with which patch size.

The paper trains "the last N conv layers" of a segmentor. "Last" has to mean
*forward execution order on the inference path*: module
registration order lies (every mmseg head registers its classifier
``conv_seg`` first; UPerHead registers ``lateral_convs`` before the PPM
``bottleneck`` it runs earlier). So the segmentor is run
once on a dummy input with forward hooks on every ``nn.Conv2d``, through
mmseg's own ``encode_decode``: ``extract_feat``, then the decode head's
``predict`` (for a ``CascadeEncoderDecoder``: ``forward`` of every head but
the last, each fed the previous head's output, then ``predict`` of the last
one, e.g. PointRend's ``PointHead`` with its point subdivision). Its result,
the segmentation logits, is *the output*. Auxiliary heads are run afterwards
and marked: they are a training aid, not part of the network being
finetuned.

"The last N" counts only convs that a gradient of the loss on the output can
reach. The trace records autograd's graph (every parameter temporarily
requires a gradient; no activation is kept, as nothing is back-propagated),
and a conv counts when the node that computed its output is in the graph
behind the output. Convs whose result is used under ``torch.no_grad`` or
detached drop out by themselves, without naming them: EMANet's
``decode_head.ema_mid_conv`` (which mmseg freezes on purpose; its output only
drives the EM iterations, run without autograd), or DANet's side classifiers
``pam_conv_seg`` / ``cam_conv_seg``, which feed training-only losses as an
auxiliary head does. Activation checkpointing (``with_cp``) is switched off
during the trace, since a reentrant checkpoint runs its forward without
autograd.

The classifiers are every decode head's final layer: ``conv_seg`` of an
mmseg ``BaseDecodeHead`` (``decode_head.conv_seg``, or
``decode_head.<i>.conv_seg`` for each head of a cascade, e.g. OCRNet's
``FCNHead`` and ``OCRHead``) and ``fc_seg`` of PointRend's ``PointHead``
(a ``Conv1d``; its point MLP ``fcs`` is made of ``Conv1d`` layers too, which
are not convs here and stay frozen). Classifiers are always trained and
never counted among the N layers unless named explicitly; ``num_layers``
refuses a segmentor where no classifier conv feeds the output (Segmenter's
mask transformer head and SAN's CLIP head compute class scores from class
embeddings).
"""
import contextlib
import difflib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..accounting.conv_cost import ConvGeometry, output_stride
from ..models.gf_conv import is_filterable_conv
from ..models.segmentor import (CLASSIFIER_NAMES, NORM_TYPES, is_classifier,
                                unwrap_model)
from ..ops import as_pair, check_radius

RadiusSetting = Union[int, str, Dict[str, Union[int, str]]]

__all__ = [
    'ConvRecord', 'LayerChoice', 'trace_convs', 'select_layers',
    'auto_radius', 'resolve_radius', 'check_radius_paths'
]


@dataclass
class ConvRecord:
    """A conv seen during the trace (first call only).

    Attributes:
        path: dotted module path in the segmentor.
        module: the conv module.
        in_shape: input ``(C, H, W)``.
        out_shape: output ``(C, H, W)``.
        inference: True if it ran on the inference path (backbone, neck,
            decode head); False for auxiliary heads.
        input_requires_grad: whether its input needed a gradient (only
            meaningful for a trace with ``grad=True``).
        norm_path: the norm layer that consumed this conv's output
            immediately after it, if any (``conv -> bn`` in a ConvModule or a
            ResNet block); with ``train_norm=True`` it is trained too.
        feeds_output: the output (the segmentation logits of the inference
            path) depends on this conv's output through autograd, in any of
            its calls: a gradient of the loss on the output reaches it.
            None for a trace with ``grad=True`` (not determined there).
        feeds_heads: some head output depends on it: the output, any output
            of a decode head's ``forward`` (DANet's side classifiers) or of
            an auxiliary head; False means no loss gradient reaches it.
            None for a trace with ``grad=True``.
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


@dataclass
class LayerChoice:
    """One selected conv: where it is, what it computes, which radius.

    Attributes:
        path: dotted module path (a ``state_dict`` prefix).
        module: the conv module (after surgery: the GFConv2d).
        radius: patch size ``r``.
        in_shape, out_shape: ``(C, H, W)`` at the trace's input size.
        kernel_size, stride, dilation: ``(h, w)`` pairs.
        groups: conv groups.
        norm_path: norm layer directly following the conv, if any.
        input_hw: the trace's input size (to rescale costs if needed).
    """

    path: str
    module: nn.Module
    radius: int
    in_shape: Tuple[int, int, int]
    out_shape: Tuple[int, int, int]
    kernel_size: Tuple[int, int]
    stride: Tuple[int, int]
    dilation: Tuple[int, int]
    groups: int
    norm_path: Optional[str] = None
    input_hw: Tuple[int, int] = field(default=(0, 0))

    @property
    def output_stride(self) -> int:
        """Input-image pixels per output pixel of this conv (1, 2, 4, ...)."""
        return output_stride(self.input_hw[0], self.out_shape[1])

    @property
    def geometry(self) -> ConvGeometry:
        """Its shapes and hyper-parameters, for the cost model."""
        return ConvGeometry(tuple(self.in_shape), tuple(self.out_shape),
                            self.kernel_size, self.stride, self.dilation,
                            self.groups)


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
    """Record every result of the method ``obj.<name>``, however called.

    mmseg calls heads' ``forward`` directly (``decode_head.forward(x)``,
    ``self.forward(...)`` inside ``predict``), which module forward hooks do
    not see; an instance attribute shadowing the method does. Returns the
    function that undoes it.
    """
    had = name in obj.__dict__
    previous = obj.__dict__.get(name)
    original = getattr(obj, name)

    def method(*args, **kwargs):
        out = original(*args, **kwargs)
        sink.append(out)
        return out

    setattr(obj, name, method)

    def restore():
        if had:
            setattr(obj, name, previous)
        else:
            delattr(obj, name)

    return restore


def _head_list(head) -> List[nn.Module]:
    if head is None:
        return []
    return list(head) if isinstance(head, nn.ModuleList) else [head]


def _run_inference_path(model: nn.Module, x: torch.Tensor,
                        aux_marker: List[bool]):
    """mmseg's ``encode_decode``, then the auxiliary heads (marked).

    The auxiliary heads get the features ``encode_decode`` extracted. A
    model without ``encode_decode`` runs ``extract_feat`` and the decode
    head(s') ``forward``, a cascade feeding each head the previous output.

    Returns:
        ``(output, side_outputs)``: the segmentation logits, and the
        auxiliary heads' outputs.
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
        heads = _head_list(model.decode_head)
        out = heads[0].forward(feats[0])
        for head in heads[1:]:
            out = head.forward(feats[0], out)
    side = []
    aux = _head_list(getattr(model, 'auxiliary_head', None))
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


def trace_convs(model: nn.Module,
                input_size: Sequence[int] = (512, 512),
                grad: bool = False) -> List[ConvRecord]:
    """Run the segmentor once and list its convs in execution order.

    The model is run in eval mode (batch 1 is then safe for BN and pooling)
    with autograd recording but no activation saved for backward (nothing
    is back-propagated), and its training flags, parameters'
    ``requires_grad`` and ``with_cp`` flags are restored afterwards, so the
    trace changes no state (no BN statistics update).

    Args:
        model: an mmseg segmentor with ``extract_feat`` and ``decode_head``
            (``EncoderDecoder`` or ``CascadeEncoderDecoder``; see the module
            docstring for what is run).
        input_size: ``(H, W)`` of the dummy input; shapes in the records are
            at this size, so use the training crop.
        grad: False (default): every parameter requires a gradient during
            the trace, which records which convs feed the output
            (``feeds_output``, ``feeds_heads``). True: the parameters keep
            their own ``requires_grad``, to learn which convs receive an
            input that needs a gradient (after surgery: which chosen layers
            must compute ``g_x``; ``input_requires_grad``).

    Returns:
        One :class:`ConvRecord` per ``nn.Conv2d`` that ran, first call order;
        inference-path convs first, then auxiliary-head ones.
    """
    model = unwrap_model(model)
    if not (hasattr(model, 'extract_feat') and hasattr(model, 'decode_head')):
        raise ValueError(
            'gradient filter layer selection needs an mmseg segmentor with '
            f'extract_feat and decode_head, got {type(model).__name__}')
    hooks = _ConvHooks(model, grad)
    head_outputs: List = []
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device('cpu')
    h, w = (int(v) for v in input_size)
    with hooks.installed(), _captured_heads(model, head_outputs), \
            _trace_state(model, grad), torch.enable_grad(), \
            torch.autograd.graph.saved_tensors_hooks(_drop_saved,
                                                     _no_unpack):
        out, side = _run_inference_path(
            model, torch.zeros(1, 3, h, w, device=device), hooks.aux_marker)
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


class _ConvHooks:
    """Forward hooks of the selection trace: a :class:`ConvRecord` per conv
    (first call), the autograd node of every call, and which norm layer
    directly consumes a conv's output."""

    def __init__(self, model: nn.Module, grad: bool) -> None:
        self.model = model
        self.grad = grad
        self.names = {m: n for n, m in model.named_modules()}
        self.records: Dict[nn.Module, ConvRecord] = {}
        self.nodes: Dict[nn.Module, list] = {}
        self.aux_marker = [False]
        self.last_conv: Optional[Tuple[ConvRecord, torch.Tensor]] = None

    def conv_hook(self, module, inputs, output) -> None:
        if isinstance(output, torch.Tensor) and output.grad_fn is not None:
            self.nodes.setdefault(module, []).append(output.grad_fn)
        if module in self.records or not isinstance(output, torch.Tensor):
            self.last_conv = None
            return
        rec = ConvRecord(self.names[module], module,
                         tuple(inputs[0].shape[1:]), tuple(output.shape[1:]),
                         not self.aux_marker[0],
                         input_requires_grad=bool(self.grad)
                         and inputs[0].requires_grad)
        self.records[module] = rec
        self.last_conv = (rec, output)

    def norm_hook(self, module, inputs, output) -> None:
        # A norm "directly follows" a conv when it consumes that very tensor.
        last = self.last_conv
        if last is not None and inputs and inputs[0] is last[1] and \
                last[0].norm_path is None:
            last[0].norm_path = self.names[module]
        self.last_conv = None

    @contextlib.contextmanager
    def installed(self):
        handles = []
        for m in self.model.modules():
            if isinstance(m, nn.Conv2d):
                handles.append(m.register_forward_hook(self.conv_hook))
            elif isinstance(m, NORM_TYPES):
                handles.append(m.register_forward_hook(self.norm_hook))
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()


@contextlib.contextmanager
def _captured_heads(model: nn.Module, sink: List):
    """Every decode head's ``forward`` results go to ``sink``."""
    restores = [_capture(head, 'forward', sink)
                for head in _head_list(model.decode_head)]
    try:
        yield sink
    finally:
        for restore in restores:
            restore()


@contextlib.contextmanager
def _trace_state(model: nn.Module, grad: bool):
    """Eval mode, activation checkpointing off and (``grad=False``) every
    parameter requiring a gradient for the block; all restored after."""
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


def auto_radius(output_stride: int) -> int:
    """The 'auto' radius rule: coarser maps get smaller patches.

    ``r`` from the conv's output stride relative to the input image:
    stride <= 4 -> 8, stride 8 -> 4, stride >= 16 -> 2, as in the reference
    UPerNet setting (8/4/2 by resolution). A patch then covers about the same
    image area (~32 px) at every level. Note that dilated ``d8`` backbones
    (PSPNet / DeepLabV3 / FCN ``*-d8``) keep layer3, layer4 and the head at
    1/8, so all their usual "last N" layers get ``r = 4``.

    Dilation is deliberately ignored: the operator handles ``d >= r`` on the
    pooled grid (taps kept at dilation ``d // r``), and the ASPP dilations
    12/24/36 are multiples of 4. The reference DeepLabV3 hand-tunes larger
    patches for the dilated ASPP branches (3/3/3/6/9 for dilations
    1/12/24/36); to reproduce that, give ``radius`` as a dict, e.g.
    ``{'*': 3, 'decode_head.aspp_modules.2': 6,
    'decode_head.aspp_modules.3': 9}``.

    Args:
        output_stride: input-image pixels per output pixel of the conv.
    """
    if output_stride <= 4:
        return 8
    if output_stride <= 8:
        return 4
    return 2


def _prefix_match(path: str, prefix: str) -> bool:
    return prefix in ('', '*') or path == prefix or path.startswith(prefix +
                                                                    '.')


def resolve_radius(radius: RadiusSetting, path: str,
                   output_stride: int) -> int:
    """The radius of one layer from the ``radius`` setting.

    Args:
        radius: an int, ``'auto'`` (see :func:`auto_radius`), or a dict
            ``{module path prefix: int or 'auto'}``; the longest prefix
            matching whole path components wins (``'backbone.layer4'``
            matches ``backbone.layer4.1.conv2``, not ``backbone.layer40``);
            key ``'*'`` is the fallback.
        path: the layer's module path.
        output_stride: the layer's output stride, for ``'auto'``.

    Raises:
        ValueError: bad value, or a dict with no key matching ``path``.
    """
    if isinstance(radius, dict):
        keys = [k for k in radius if _prefix_match(path, k)]
        if not keys:
            raise ValueError(
                f'gradient_filter radius: no key of {sorted(radius)} matches '
                f'layer {path!r}; add a prefix of it or a "*" fallback')
        best = max(keys, key=lambda k: -1 if k == '*' else len(k))
        return resolve_radius(radius[best], path, output_stride)
    if radius == 'auto':
        return auto_radius(output_stride)
    if isinstance(radius, str):
        raise ValueError(
            "gradient_filter radius must be an int >= 1, 'auto' or a dict "
            f'{{path: int or "auto"}}, got {radius!r}')
    return check_radius(radius)


def check_radius_paths(model: nn.Module, radius: RadiusSetting) -> None:
    """Refuse a ``radius`` dict with a key that is no module path of
    ``model`` (a typo), whatever else it holds: a ``'*'`` fallback would
    otherwise give the misspelt layers its radius without a word.

    Raises:
        ValueError: naming the key, close matches and the allowed keys.
    """
    if not isinstance(radius, dict):
        return
    paths = [n for n, _ in model.named_modules() if n]
    known = set(paths)
    for key in radius:
        if key in ('', '*') or (isinstance(key, str) and key in known):
            continue
        close = difflib.get_close_matches(str(key), paths, n=3)
        hint = f'; did you mean {close}?' if close else ''
        raise ValueError(
            f'gradient_filter radius: no module {key!r} in '
            f'{type(model).__name__}{hint}; allowed keys: \'*\' (the '
            'fallback) or module paths of the model (a layer or a '
            'container of layers, e.g. \'decode_head\'), values: an int '
            '>= 1 or \'auto\'')


def _check_filterable(path: str, module: nn.Module) -> None:
    if not is_filterable_conv(module):
        raise ValueError(
            f'gradient_filter layers: {path!r} is a '
            f'{type(module).__name__}, which cannot be gradient-filtered; '
            'allowed: nn.Conv2d, mmcv Conv2d, GFConv2d (not e.g. ConvWS, '
            'DeformConv, ConvTranspose)')


def _listing(paths: Sequence[str], limit: int = 6) -> str:
    more = f' and {len(paths) - limit} more' if len(paths) > limit else ''
    return f'{list(paths[:limit])}{more}'


def select_layers(model: nn.Module,
                  num_layers: Optional[int] = None,
                  layers: Optional[Sequence[str]] = None,
                  radius: RadiusSetting = 4,
                  input_size: Sequence[int] = (512, 512),
                  records: Optional[List[ConvRecord]] = None
                  ) -> List[LayerChoice]:
    """Choose the convs to gradient-filter.

    Exactly one of ``num_layers`` / ``layers`` must be given.

    Args:
        model: an mmseg segmentor (unwrapped or wrapped).
        num_layers: the last N convs in forward execution order on the
            inference path that a gradient of the loss on the output reaches
            (``feeds_output``); classifiers excluded (they are always
            trained anyway).
        layers: module paths; a conv is taken as is, a container stands for
            every conv inside it in execution order that some loss gradient
            reaches (``feeds_heads``; a head's classifier is only taken when
            named itself).
        radius: int, ``'auto'`` or ``{path prefix: int|'auto'}``, see
            :func:`resolve_radius`.
        input_size: ``(H, W)`` of the trace.
        records: a precomputed :func:`trace_convs` result (of a trace with
            ``grad=False``; otherwise the model is traced again).

    Returns:
        list[LayerChoice]: in execution order.

    Raises:
        ValueError: bad ``num_layers`` (< 1 or more than the convs there
            are), a segmentor without a classifier (``num_layers``), unknown
            path (with close matches), a named conv that no loss gradient
            reaches, non-filterable conv, model without convs, bad radius.
    """
    if (num_layers is None) == (layers is None):
        raise ValueError('gradient_filter: give exactly one of num_layers '
                         f'and layers, got num_layers={num_layers!r}, '
                         f'layers={layers!r}')
    model = unwrap_model(model)
    check_radius_paths(model, radius)
    if records is None or any(r.feeds_output is None for r in records):
        records = trace_convs(model, input_size)
    if not records:
        raise ValueError(
            f'gradient_filter: {type(model).__name__} ran no nn.Conv2d on '
            'its inference path; nothing can be gradient-filtered')
    if num_layers is not None:
        chosen = _last_n_layers(model, records, num_layers)
    else:
        chosen = _named_layers(model, records, layers)
    return [_layer_choice(rec, radius, input_size) for rec in chosen]


def _last_n_layers(model: nn.Module, records: List[ConvRecord],
                   num_layers) -> List[ConvRecord]:
    """The last ``num_layers`` inference-path convs that feed the output,
    classifiers excluded (see :func:`select_layers`)."""
    name = type(model).__name__
    classifiers = [
        r.path for r in records
        if is_classifier(r.path) and r.inference and r.feeds_output
    ]
    if not classifiers:
        heads = [type(m).__name__ for m in _head_list(model.decode_head)]
        raise ValueError(
            f'gradient_filter: the decode head of {name} ({heads}) has '
            'no classifier conv (conv_seg) that the output depends on; '
            'gradient filtering always trains it: its class scores come '
            'from layers that num_layers cannot select (not nn.Conv2d, '
            'e.g. class embeddings), so they would stay frozen. Allowed: '
            "a segmentor whose decode heads end in mmseg's conv_seg")
    ran = [r for r in records if r.inference and not is_classifier(r.path)]
    pool = [r for r in ran if r.feeds_output]
    unreached = [r.path for r in ran if not r.feeds_output]
    if not pool:
        raise ValueError(
            f'gradient_filter: {name} runs no conv on its inference '
            f'path that the output depends on besides its classifiers '
            f'{classifiers}, so num_layers has nothing to choose from '
            '(allowed: a segmentor with nn.Conv2d layers; to train the '
            'classifier alone, use CalibrationHook(trainable=[...]) as '
            'configs/_base_/strategies/classifier_only.py does)')
    if isinstance(num_layers, bool) or not isinstance(
            num_layers, int) or not 1 <= num_layers <= len(pool):
        note = (f'; not counted, as no gradient of the output reaches '
                f'them: {_listing(unreached)}' if unreached else '')
        raise ValueError(
            f'gradient_filter num_layers must be an int in '
            f'[1, {len(pool)}] ({name} runs {len(pool)} convs besides '
            f'the classifier that the output depends on{note}), got '
            f'{num_layers!r}')
    return pool[-num_layers:]


def _named_layers(model: nn.Module, records: List[ConvRecord],
                  layers) -> List[ConvRecord]:
    """The convs that ``layers`` (module paths) name, in execution order."""
    if isinstance(layers, str):
        layers = [layers]
    if not layers:
        raise ValueError('gradient_filter layers must be a non-empty '
                         'list of module paths')
    modules = dict(model.named_modules())
    chosen: List[ConvRecord] = []
    for path in layers:
        for rec in _convs_reached_in(model, modules, records, path):
            if rec not in chosen:
                chosen.append(rec)
    order = {id(r): i for i, r in enumerate(records)}
    return sorted(chosen, key=lambda r: order[id(r)])


def _convs_reached_in(model: nn.Module, modules: Dict[str, nn.Module],
                      records: List[ConvRecord],
                      path: str) -> List[ConvRecord]:
    """The convs at or inside ``path`` that some loss gradient reaches (a
    head's classifier only when named itself); errors name the path."""
    if path not in modules:
        close = difflib.get_close_matches(path, list(modules), n=3)
        hint = f'; did you mean {close}?' if close else ''
        raise ValueError(f'gradient_filter layers: no module {path!r} in '
                         f'{type(model).__name__}{hint}')
    if is_classifier(path):
        raise ValueError(
            f'gradient_filter layers: {path!r} is the decode head\'s '
            'classifier, which every setting trains with its exact '
            'gradient (fused with the loss) and never filters; allowed: '
            'the convs before it. To train the classifier alone, use '
            'CalibrationHook(trainable=[...]) as '
            'configs/_base_/strategies/classifier_only.py does')
    mod = modules[path]
    inside = [
        r for r in records
        if r.path == path or (r.path.startswith(path + '.') and
                              r.path.split('.')[-1] not in CLASSIFIER_NAMES)
    ]
    if not inside:
        if isinstance(mod, nn.Conv2d):
            raise ValueError(f'gradient_filter layers: conv {path!r} never '
                             'runs in the forward pass')
        raise ValueError(
            f'gradient_filter layers: {path!r} ({type(mod).__name__}) '
            'contains no conv that runs in the forward pass; allowed: a '
            'conv or a container of convs')
    reached = [r for r in inside if r.feeds_heads]
    if not reached:
        raise ValueError(
            f'gradient_filter layers: no loss gradient reaches {path!r}: no '
            f'head output depends on {_listing([r.path for r in inside])} '
            'through autograd (used under torch.no_grad or detached, e.g. '
            "EMANet's ema_mid_conv), so training it would change nothing; "
            'allowed: convs that the output or a head depends on')
    return reached


def _layer_choice(rec: ConvRecord, radius: RadiusSetting,
                  input_size: Sequence[int]) -> LayerChoice:
    """A traced conv as a :class:`LayerChoice` with its radius resolved."""
    _check_filterable(rec.path, rec.module)
    conv = rec.module
    h, w = int(input_size[0]), int(input_size[1])
    return LayerChoice(
        path=rec.path,
        module=conv,
        radius=resolve_radius(radius, rec.path,
                              output_stride(h, rec.out_shape[1])),
        in_shape=rec.in_shape,
        out_shape=rec.out_shape,
        kernel_size=as_pair(conv.kernel_size),
        stride=as_pair(conv.stride),
        dilation=as_pair(conv.dilation),
        groups=conv.groups,
        norm_path=rec.norm_path,
        input_hw=(h, w))
