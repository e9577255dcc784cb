"""Which convolutions to gradient-filter, and with which patch size.

The paper trains "the last N conv layers" of a segmentor. "Last" has to mean
*forward execution order on the inference path*: module
registration order lies (every mmseg head registers its classifier
``conv_seg`` first; UPerHead registers ``lateral_convs`` before the PPM
``bottleneck`` it runs earlier). So the segmentor is run
once on a dummy input with forward hooks on every conv, through
``extract_feat`` + ``decode_head.forward`` (auxiliary heads are a training
aid, not part of the network being finetuned, and are excluded). The
classifier ``decode_head.conv_seg`` is always trained and is not counted
among the N layers unless named explicitly.
"""
import difflib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from ..models.gf_conv import is_filterable_conv
from ..ops import check_radius
from .utils import unwrap_model

RadiusSetting = Union[int, str, Dict[str, Union[int, str]]]

NORM_TYPES = (_BatchNorm, _InstanceNorm, nn.GroupNorm, nn.LayerNorm)

__all__ = [
    'ConvRecord', 'LayerChoice', 'trace_convs', 'select_layers',
    'auto_radius', 'resolve_radius', 'is_classifier', 'CLASSIFIER_SUFFIX'
]

#: mmseg's ``BaseDecodeHead`` names its final 1x1 classifier ``conv_seg``.
CLASSIFIER_SUFFIX = 'conv_seg'


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
    """

    path: str
    module: nn.Module
    in_shape: Tuple[int, int, int]
    out_shape: Tuple[int, int, int]
    inference: bool = True
    norm_path: Optional[str] = None
    input_requires_grad: bool = False


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
        return max(1, round(self.input_hw[0] / max(self.out_shape[1], 1)))


def _run_inference_path(model: nn.Module, x: torch.Tensor,
                        aux_marker: List[bool]) -> None:
    """extract_feat + decode_head(s), then auxiliary heads (marked)."""
    feats = model.extract_feat(x)
    head = model.decode_head
    if isinstance(head, nn.ModuleList):  # CascadeEncoderDecoder
        out = head[0].forward(feats)
        for h in head[1:]:
            out = h.forward(feats, out)
    else:
        head.forward(feats)
    aux = getattr(model, 'auxiliary_head', None)
    if aux is not None:
        aux_marker[0] = True
        heads = aux if isinstance(aux, nn.ModuleList) else [aux]
        for h in heads:
            h.forward(feats)


def trace_convs(model: nn.Module,
                input_size: Sequence[int] = (512, 512),
                grad: bool = False) -> List[ConvRecord]:
    """Run the segmentor once and list its convs in execution order.

    The model is run in eval mode (batch 1 is then safe for BN and pooling),
    under ``no_grad`` by default, and its training flags are restored
    afterwards, so the trace changes no state (no BN statistics update).

    Args:
        model: an mmseg segmentor with ``extract_feat`` and ``decode_head``
            (``EncoderDecoder``; ``CascadeEncoderDecoder`` also works).
        input_size: ``(H, W)`` of the dummy input; shapes in the records are
            at this size, so use the training crop.
        grad: run with autograd on, to learn which convs receive an input
            that needs a gradient (after surgery: which chosen layers must
            compute ``g_x``). Default False (``no_grad``).

    Returns:
        One :class:`ConvRecord` per ``nn.Conv2d`` that ran, first call order;
        inference-path convs first, then auxiliary-head ones.
    """
    model = unwrap_model(model)
    if not (hasattr(model, 'extract_feat') and hasattr(model, 'decode_head')):
        raise ValueError(
            'gradient filter layer selection needs an mmseg segmentor with '
            f'extract_feat and decode_head, got {type(model).__name__}')
    names = {m: n for n, m in model.named_modules()}
    records: Dict[nn.Module, ConvRecord] = {}
    aux_marker = [False]
    last_conv: List[Optional[Tuple[ConvRecord, torch.Tensor]]] = [None]

    def conv_hook(module, inputs, output):
        if module not in records and isinstance(output, torch.Tensor):
            rec = ConvRecord(names[module], module,
                             tuple(inputs[0].shape[1:]),
                             tuple(output.shape[1:]), not aux_marker[0],
                             input_requires_grad=inputs[0].requires_grad)
            records[module] = rec
            last_conv[0] = (rec, output)
        else:
            last_conv[0] = None

    def norm_hook(module, inputs, output):
        # A norm "directly follows" a conv when it consumes that very tensor.
        if last_conv[0] is not None and inputs and \
                inputs[0] is last_conv[0][1] and last_conv[0][0].norm_path \
                is None:
            last_conv[0][0].norm_path = names[module]
        last_conv[0] = None

    handles = []
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            handles.append(m.register_forward_hook(conv_hook))
        elif isinstance(m, NORM_TYPES):
            handles.append(m.register_forward_hook(norm_hook))
    modes = {m: m.training for m in model.modules()}
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device('cpu')
    try:
        model.eval()
        h, w = (int(v) for v in input_size)
        with torch.set_grad_enabled(grad):
            _run_inference_path(model,
                                torch.zeros(1, 3, h, w, device=device),
                                aux_marker)
    finally:
        for handle in handles:
            handle.remove()
        for m, mode in modes.items():
            m.training = mode
    return list(records.values())


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


def _pair(v) -> Tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def is_classifier(path: str) -> bool:
    """The decode head's classifier (``decode_head[.i].conv_seg``), which
    every strategy trains and no layer count includes."""
    return path.startswith('decode_head') and path.split(
        '.')[-1] == CLASSIFIER_SUFFIX


def _check_filterable(path: str, module: nn.Module) -> None:
    if not is_filterable_conv(module):
        raise ValueError(
            f'gradient_filter layers: {path!r} is a '
            f'{type(module).__name__}, which cannot be gradient-filtered; '
            'allowed: nn.Conv2d, mmcv Conv2d, GFConv2d (not e.g. ConvWS, '
            'DeformConv, ConvTranspose)')


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
            inference path, ``decode_head.conv_seg`` excluded (it is always
            trained anyway).
        layers: module paths; a conv is taken as is, a container stands for
            every conv inside it in execution order (a head's classifier
            ``conv_seg`` is only taken when named itself).
        radius: int, ``'auto'`` or ``{path prefix: int|'auto'}``, see
            :func:`resolve_radius`.
        input_size: ``(H, W)`` of the trace.
        records: a precomputed :func:`trace_convs` result.

    Returns:
        list[LayerChoice]: in execution order.

    Raises:
        ValueError: bad ``num_layers`` (< 1 or more than the convs there
            are), unknown path (with close matches), non-filterable conv,
            model without convs, bad radius.
    """
    if (num_layers is None) == (layers is None):
        raise ValueError('gradient_filter: give exactly one of num_layers '
                         f'and layers, got num_layers={num_layers!r}, '
                         f'layers={layers!r}')
    model = unwrap_model(model)
    if records is None:
        records = trace_convs(model, input_size)
    if not records:
        raise ValueError(
            f'gradient_filter: {type(model).__name__} ran no nn.Conv2d on '
            'its inference path; nothing can be gradient-filtered')
    h = int(input_size[0])
    chosen: List[ConvRecord] = []
    if num_layers is not None:
        pool = [
            r for r in records if r.inference and not is_classifier(r.path)
        ]
        if not pool:
            classifiers = [r.path for r in records if is_classifier(r.path)]
            raise ValueError(
                f'gradient_filter: {type(model).__name__} runs no conv on '
                f'its inference path besides its classifier {classifiers}, '
                'so num_layers has nothing to choose from (allowed: a '
                'segmentor with nn.Conv2d layers; to train the classifier '
                "alone, use layers=['decode_head.conv_seg'])")
        if isinstance(num_layers, bool) or not isinstance(
                num_layers, int) or not 1 <= num_layers <= len(pool):
            raise ValueError(
                f'gradient_filter num_layers must be an int in '
                f'[1, {len(pool)}] ({type(model).__name__} runs {len(pool)} '
                f'convs besides the classifier), got {num_layers!r}')
        chosen = pool[-num_layers:]
    else:
        if isinstance(layers, str):
            layers = [layers]
        if not layers:
            raise ValueError('gradient_filter layers must be a non-empty '
                             'list of module paths')
        modules = dict(model.named_modules())
        for path in layers:
            if path not in modules:
                close = difflib.get_close_matches(path, list(modules), n=3)
                hint = f'; did you mean {close}?' if close else ''
                raise ValueError(
                    f'gradient_filter layers: no module {path!r} in '
                    f'{type(model).__name__}{hint}')
            mod = modules[path]
            inside = [
                r for r in records
                if r.path == path or (
                    r.path.startswith(path + '.')
                    and r.path.split('.')[-1] != CLASSIFIER_SUFFIX)
            ]
            if not inside:
                if isinstance(mod, nn.Conv2d):
                    raise ValueError(
                        f'gradient_filter layers: conv {path!r} never runs '
                        'in the forward pass')
                raise ValueError(
                    f'gradient_filter layers: {path!r} '
                    f'({type(mod).__name__}) contains no conv that runs in '
                    'the forward pass; allowed: a conv or a container of '
                    'convs')
            for rec in inside:
                if rec not in chosen:
                    chosen.append(rec)
        order = {id(r): i for i, r in enumerate(records)}
        chosen.sort(key=lambda r: order[id(r)])
    result = []
    for rec in chosen:
        _check_filterable(rec.path, rec.module)
        conv = rec.module
        out_stride = max(1, round(h / max(rec.out_shape[1], 1)))
        result.append(
            LayerChoice(
                path=rec.path,
                module=conv,
                radius=resolve_radius(radius, rec.path, out_stride),
                in_shape=rec.in_shape,
                out_shape=rec.out_shape,
                kernel_size=_pair(conv.kernel_size),
                stride=_pair(conv.stride),
                dilation=_pair(conv.dilation),
                groups=conv.groups,
                norm_path=rec.norm_path,
                input_hw=(int(input_size[0]), int(input_size[1]))))
    return result
