"""Backward cost of a whole segmentor: its trained convs, traced.

Decides which convs a model trains, with which shapes, radii and ``g_x``
needs, and costs each with
:func:`mmseg_gf.ops.conv.cost.conv_backward_cost`: a filtered model's
chosen convs at their radii, or every inference-path conv (``mode='all'``,
the paper's "Vanilla BP All"). The classifier is trained by every strategy
and reported apart (the paper's "#Layers" convention); ``g_x`` is counted
where a trained parameter lies upstream (docs/cost.md).
"""
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torch import nn

from ..ops.conv.cost import ConvBackwardCost
from ..accounting.saved_bytes import trace_step_saved_bytes
from ..engine.build import build_segmentor
from ..engine.config import config_settings
from ..engine.layer_trace import LayerRecord, trace_layers
from ..engine.state import get_state
from ..models.layer_kinds import CONV2D, family_kind_of, layer_kinds
from ..models.segmentor import is_classifier, unwrap_model

__all__ = [
    'LayerCost', 'ModelCost', 'model_backward_cost', 'config_backward_cost',
    'config_step_saved_bytes'
]


@dataclass
class LayerCost:
    """One trained layer and its backward cost (a
    :class:`ConvBackwardCost`)."""

    path: str
    geometry: Any
    in_shape: Tuple[int, int, int]
    out_shape: Tuple[int, int, int]
    radius: int
    need_input_grad: bool
    cost: ConvBackwardCost
    kind: str = CONV2D.name

    @property
    def describe(self) -> str:
        """The layer kind's table cell (a conv's ``k/s/d/g``, a Linear's token
        grid)."""
        return self.geometry.describe()

    # a layer on tokens is a 1x1 conv on its grid
    @property
    def kernel_size(self) -> Tuple[int, int]:
        return getattr(self.geometry, 'kernel_size', (1, 1))

    @property
    def stride(self) -> Tuple[int, int]:
        return getattr(self.geometry, 'stride', (1, 1))

    @property
    def dilation(self) -> Tuple[int, int]:
        return getattr(self.geometry, 'dilation', (1, 1))

    @property
    def groups(self) -> int:
        return getattr(self.geometry, 'groups', 1)

    @property
    def vanilla_macs(self) -> int:
        """Multiply-accumulates of the exact backward (1 MAC = 2 FLOPs)."""
        return self.cost.vanilla_flops // 2

    @property
    def gf_macs(self) -> int:
        """Multiply-accumulates of the filtered ``g_x`` / ``g_W`` products."""
        return (self.cost.gf_grad_input_flops +
                self.cost.gf_grad_weight_flops) // 2

    def as_dict(self) -> Dict[str, Any]:
        c = self.cost
        return dict(
            path=self.path, kind=self.kind,
            kernel_size=list(self.kernel_size),
            stride=list(self.stride), dilation=list(self.dilation),
            groups=self.groups, in_shape=list(self.in_shape),
            out_shape=list(self.out_shape), radius=self.radius,
            need_input_grad=self.need_input_grad,
            vanilla_flops=c.vanilla_flops,
            vanilla_grad_input_flops=c.vanilla_grad_input_flops,
            vanilla_grad_weight_flops=c.vanilla_grad_weight_flops,
            vanilla_macs=self.vanilla_macs, gf_flops=c.gf_flops,
            gf_grad_input_flops=c.gf_grad_input_flops,
            gf_grad_weight_flops=c.gf_grad_weight_flops,
            gf_overhead_flops=c.gf_overhead_flops, gf_macs=self.gf_macs,
            gf_forward_overhead_flops=c.gf_forward_overhead_flops,
            vanilla_saved_bytes=c.vanilla_saved_bytes,
            gf_saved_bytes=c.gf_saved_bytes)


_TOTAL_KEYS = ('vanilla_flops', 'gf_flops', 'vanilla_macs', 'gf_macs',
               'vanilla_saved_bytes', 'gf_saved_bytes',
               'gf_forward_overhead_flops')


@dataclass
class ModelCost:
    """The trained convs of a model and their summed backward costs.

    Attributes:
        mode: ``'gf'`` / ``'vanilla'`` (a gradient-filter setting's layers) or
            ``'all'`` (every inference-path conv, exact backward).
        classifier: the classifier's cost (trained, not counted), if it ran.
        not_counted: ``mode='all'``: trainable layers of other kinds, by
            class name: the count covers convs only.
    """

    mode: str
    input_size: Tuple[int, int]
    batch: int
    layers: List[LayerCost] = field(default_factory=list)
    classifier: Optional[LayerCost] = None
    collapse_dilated: bool = False
    not_counted: Dict[str, int] = field(default_factory=dict)

    def total(self, key: str) -> int:
        """Sum of a :class:`LayerCost` property / cost field over layers."""
        if key in ('vanilla_macs', 'gf_macs'):
            return sum(getattr(layer, key) for layer in self.layers)
        return sum(getattr(layer.cost, key) for layer in self.layers)

    @property
    def vanilla_flops(self) -> int:
        return self.total('vanilla_flops')

    @property
    def gf_flops(self) -> int:
        return self.total('gf_flops')

    @property
    def flops(self) -> int:
        """The backward FLOPs the model actually runs (filtered for
        ``mode='gf'``)."""
        return self.gf_flops if self.mode == 'gf' else self.vanilla_flops

    def layer_flops(self, layer: LayerCost) -> int:
        """One layer's FLOPs under this model's mode."""
        return (layer.cost.gf_flops
                if self.mode == 'gf' else layer.cost.vanilla_flops)

    def totals(self) -> Dict[str, int]:
        return {k: self.total(k) for k in _TOTAL_KEYS}

    def as_dict(self) -> Dict[str, Any]:
        return dict(
            mode=self.mode, input_size=list(self.input_size),
            batch=self.batch, collapse_dilated=self.collapse_dilated,
            num_layers=len(self.layers), flops=self.flops,
            totals=self.totals(),
            layers=[layer.as_dict() for layer in self.layers],
            classifier=(self.classifier.as_dict()
                        if self.classifier is not None else None),
            not_counted=dict(self.not_counted))


def _layer_cost(rec: LayerRecord, radius: int, need_input_grad: bool,
                batch: int, elem_bytes: int,
                collapse_dilated: bool) -> LayerCost:
    geometry = rec.geometry
    cost = geometry.cost(radius, batch=batch,
                         need_input_grad=need_input_grad,
                         elem_bytes=elem_bytes,
                         collapse_dilated=collapse_dilated)
    return LayerCost(
        path=rec.path, geometry=geometry, in_shape=tuple(rec.in_shape),
        out_shape=tuple(rec.out_shape), radius=radius,
        need_input_grad=need_input_grad, cost=cost, kind=rec.kind)


def model_backward_cost(model: nn.Module,
                        input_size: Sequence[int] = (512, 512),
                        batch: int = 1,
                        radius: int = 4,
                        elem_bytes: int = 4,
                        collapse_dilated: bool = False,
                        records: Optional[List[LayerRecord]] = None
                        ) -> ModelCost:
    """Trace a built segmentor and cost the backward of its trained convs.

    Args:
        model: an mmseg segmentor, with or without gradient filtering.
        input_size: ``(H, W)`` of the trace (the training crop).
        batch: images per step (the counts scale linearly).
        radius: patch size of hypothetical GF columns for ``mode='all'``.
        elem_bytes: bytes per activation element.
        collapse_dilated: count the GF backward as the reference operator
            does, dilated kernels summed to one tap
            (docs/gradient_filter.md#dilated-convolutions).
        records: a precomputed ``trace_layers(model, input_size, grad=True)``.

    Returns:
        ModelCost: the counted convs (classifier apart), in execution order.
    """
    model = unwrap_model(model)
    size = tuple(int(v) for v in input_size)
    if records is None:
        records = trace_layers(model, size, grad=True)
    by_path = {r.path: r for r in records}
    state = get_state(model)
    out = ModelCost(mode='all', input_size=size, batch=int(batch),
                    collapse_dilated=collapse_dilated)
    if state is None:
        # the paper's "Vanilla BP All": convs (nn.Conv2d) only, the other
        # kinds named in ``not_counted``
        items = [(r, radius) for r in records
                 if r.inference and not is_classifier(r.path)
                 and r.kind == CONV2D.name]
        out.not_counted = _other_layer_kinds(model)
    else:
        out.mode = state.mode
        items = []
        for c in state.layers:
            rec = by_path.get(c.path)
            if rec is None:
                raise ValueError(
                    f'gradient_filter layer {c.path!r} did not run in a '
                    f'forward pass at input size {size}')
            items.append((rec, c.radius))
    for rec, r in items:
        out.layers.append(
            _layer_cost(rec, r, bool(rec.input_requires_grad),
                        out.batch, elem_bytes, collapse_dilated))
    cls = [r for r in records
           if r.inference and is_classifier(r.path)]
    if cls:
        rec = cls[-1]
        out.classifier = _layer_cost(rec, 1,
                                     bool(rec.input_requires_grad),
                                     out.batch, elem_bytes, collapse_dilated)
    return out


def _other_layer_kinds(model: nn.Module) -> Dict[str, int]:
    """Trainable layers ``mode='all'`` does not count, by kind or class
    name."""
    others = [k for k in layer_kinds() if k.traced_type is not
              CONV2D.traced_type]
    counts: Dict[str, int] = {}
    for path, module in model.named_modules():
        if path.startswith('auxiliary_head') or isinstance(
                module, CONV2D.traced_type):
            continue
        name = next((k.traced_type.__name__ for k in others
                     if k.traces(module)), None)
        if name is None and family_kind_of(module) is not None:
            name = type(module).__name__
        if name is not None:
            counts[name] = counts.get(name, 0) + 1
    return counts


def config_backward_cost(cfg, shape: Sequence[int], batch: int = 1,
                         radius: int = 4,
                         collapse_dilated: bool = False) -> ModelCost:
    """Build a config's model and cost it at ``shape``
    (``tools/analyze_cost.py``)."""
    model = build_segmentor(cfg, input_size=shape)
    return model_backward_cost(model, shape, batch=batch, radius=radius,
                               collapse_dilated=collapse_dilated)


def config_step_saved_bytes(cfg, shape: Sequence[int]):
    """The step's analytic saved bytes of a lean config; None otherwise."""
    settings = config_settings(cfg)
    if settings is None or not settings.lean:
        return None
    return trace_step_saved_bytes(build_segmentor(cfg, input_size=shape),
                                  shape)
