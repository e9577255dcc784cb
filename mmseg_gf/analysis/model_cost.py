"""Backward cost of a whole segmentor: its trained convs, traced.

The per-conv numbers all come from the single cost model
:func:`mmseg_gf.analysis.cost.conv_backward_cost`; this module only decides
*which* convs a model trains and with *which* shapes, radii and ``g_x``
needs, by tracing the built model:

* a model with gradient filtering applied (``gradient_filter`` in its
  config, or :func:`~mmseg_gf.engine.surgery.apply_gradient_filter`): the
  chosen convs, in execution order, each at its radius; ``mode`` is the
  applied one (``'gf'`` or ``'vanilla'``);
* any other model (``mode='all'``, the paper's "Vanilla BP All"): every conv
  on the inference path (the first one needs no ``g_x``).

The classifier ``decode_head.conv_seg`` is trained by every strategy and is
not counted (the paper's "#Layers" / "Calibration = 0 GFLOPs" convention);
it is reported apart (:attr:`ModelCost.classifier`).

``g_x`` is counted where the conv's input needs a gradient in the real
model, i.e. where a trained parameter lies upstream (``trace_convs(...,
grad=True)``); autograd computes the full ``g_x`` of a conv even when only
some of its input channels lead to trained layers (e.g. PSPNet's
bottleneck after the concat), and so does the count.

Used by :func:`mmseg_gf.protocol.flops.strategy_cost`,
``tools/analyze_cost.py`` and the GradFilterHook's numbers agree with it.
"""
import copy
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torch import nn

from ..engine.selection import ConvRecord, is_classifier, trace_convs
from ..engine.surgery import MODE_ATTR, get_gradient_filter_layers
from ..engine.utils import unwrap_model
from .cost import ConvBackwardCost, conv_backward_cost
from .step_memory import trace_step_saved_bytes

__all__ = [
    'LayerCost', 'ModelCost', 'build_segmentor', 'model_backward_cost',
    'config_backward_cost', 'config_step_saved_bytes', 'measure_memory',
    'random_batch', 'training_loss'
]


@dataclass
class LayerCost:
    """One trained conv and its backward cost (a :class:`ConvBackwardCost`).

    Attributes:
        path: module path in the segmentor.
        kernel_size, stride, dilation: ``(h, w)`` pairs.
        groups: conv groups.
        in_shape, out_shape: ``(C, H, W)`` at the analysed input size.
        radius: the patch size the GF columns are computed with.
        need_input_grad: whether ``g_x`` is computed (its input depends on
            a trained parameter).
        cost: the cost model's counts for the whole batch.
    """

    path: str
    kernel_size: Tuple[int, int]
    stride: Tuple[int, int]
    dilation: Tuple[int, int]
    groups: int
    in_shape: Tuple[int, int, int]
    out_shape: Tuple[int, int, int]
    radius: int
    need_input_grad: bool
    cost: ConvBackwardCost

    @property
    def vanilla_macs(self) -> int:
        """Multiply-accumulates of the exact backward (1 MAC = 2 FLOPs)."""
        return self.cost.vanilla_flops // 2

    @property
    def gf_macs(self) -> int:
        """Multiply-accumulates of the filtered ``g_x`` / ``g_W`` products
        (the overhead additions are not MACs)."""
        return (self.cost.gf_grad_input_flops +
                self.cost.gf_grad_weight_flops) // 2

    def as_dict(self) -> Dict[str, Any]:
        c = self.cost
        return dict(
            path=self.path, kernel_size=list(self.kernel_size),
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
        mode: ``'gf'`` / ``'vanilla'`` (layers chosen by a gradient-filter
            setting, filtered or exact backward) or ``'all'`` (no setting:
            every inference-path conv, exact backward).
        input_size: ``(H, W)`` of the trace.
        batch: images per step the counts are for.
        layers: one :class:`LayerCost` per counted conv, execution order.
        classifier: the classifier's cost (trained, not counted), if it ran.
        collapse_dilated: GF columns computed as the reference operator
            does, kernel always collapsed (see :func:`model_backward_cost`).
    """

    mode: str
    input_size: Tuple[int, int]
    batch: int
    layers: List[LayerCost] = field(default_factory=list)
    classifier: Optional[LayerCost] = None
    collapse_dilated: bool = False

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
        """The backward FLOPs of what the model actually runs: filtered for
        ``mode='gf'``, exact otherwise."""
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
                        if self.classifier is not None else None))


def build_segmentor(cfg, input_size: Optional[Sequence[int]] = None
                    ) -> nn.Module:
    """Build a config's segmentor with its ``gradient_filter`` applied.

    Args:
        cfg (mmengine.Config): not modified.
        input_size: if given and the config has a ``gradient_filter``
            setting without ``input_size``, the layer-selection trace runs
            at this size (cheaper for small analyses; the chosen layers are
            the same, the ``'auto'`` radius rule uses output strides).
    """
    from mmseg.registry import MODELS
    from mmseg.utils import register_all_modules

    from ..engine.config import rewrite_config
    register_all_modules(init_default_scope=False)
    cfg = copy.deepcopy(cfg)
    settings = cfg.get('gradient_filter')
    if input_size is not None and isinstance(settings, dict) and \
            settings.get('input_size') is None:
        settings = dict(settings)
        settings['input_size'] = tuple(int(v) for v in input_size)
        cfg.gradient_filter = settings
    rewrite_config(cfg)
    return MODELS.build(cfg.model)


def _layer_cost(rec: ConvRecord, conv: nn.Conv2d, radius: int,
                need_input_grad: bool, batch: int, elem_bytes: int,
                collapse_dilated: bool) -> LayerCost:
    # nn.Conv2d keeps kernel_size / stride / dilation as pairs.
    kh, kw = conv.kernel_size
    dilation = (1, 1) if collapse_dilated else conv.dilation
    cost = conv_backward_cost(
        cin=rec.in_shape[0], cout=rec.out_shape[0], kh=kh, kw=kw,
        stride=conv.stride, dilation=dilation, groups=conv.groups,
        in_hw=rec.in_shape[1:], out_hw=rec.out_shape[1:], batch=batch,
        radius=radius, need_input_grad=need_input_grad,
        elem_bytes=elem_bytes)
    return LayerCost(
        path=rec.path, kernel_size=(kh, kw), stride=tuple(conv.stride),
        dilation=tuple(conv.dilation), groups=conv.groups,
        in_shape=tuple(rec.in_shape), out_shape=tuple(rec.out_shape),
        radius=radius, need_input_grad=need_input_grad, cost=cost)


def model_backward_cost(model: nn.Module,
                        input_size: Sequence[int] = (512, 512),
                        batch: int = 1,
                        radius: int = 4,
                        elem_bytes: int = 4,
                        collapse_dilated: bool = False,
                        records: Optional[List[ConvRecord]] = None
                        ) -> ModelCost:
    """Trace a built segmentor and cost the backward of its trained convs.

    Args:
        model: an mmseg segmentor, with or without gradient filtering
            applied (e.g. from :func:`build_segmentor`).
        input_size: ``(H, W)`` of the trace (the training crop).
        batch: images per step (the counts scale linearly).
        radius: patch size of the (hypothetical) GF columns for a model
            without gradient filtering (``mode='all'``).
        elem_bytes: bytes per activation element.
        collapse_dilated: count the GF backward as the public reference
            operator computes it, the kernel always summed to one tap
            (dilation ignored), instead of this plugin's operator, which
            keeps the taps of dilated convs with ``d // (r*s) >= 1`` on the
            pooled grid (docs/gradient_filter.md#dilated-convolutions).
            Exact (vanilla) counts are unaffected.
        records: a precomputed ``trace_convs(model, input_size, grad=True)``.

    Returns:
        ModelCost: the counted convs (classifier apart), in execution order.
    """
    model = unwrap_model(model)
    size = tuple(int(v) for v in input_size)
    if records is None:
        records = trace_convs(model, size, grad=True)
    by_path = {r.path: r for r in records}
    choices = get_gradient_filter_layers(model)
    out = ModelCost(mode='all', input_size=size, batch=int(batch),
                    collapse_dilated=collapse_dilated)
    if choices is None:
        items = [(r, r.module, radius) for r in records
                 if r.inference and not is_classifier(r.path)]
    else:
        out.mode = getattr(model, MODE_ATTR, 'gf')
        items = []
        for c in choices:
            rec = by_path.get(c.path)
            if rec is None:
                raise ValueError(
                    f'gradient_filter layer {c.path!r} did not run in a '
                    f'forward pass at input size {size}')
            items.append((rec, c.module, c.radius))
    for rec, conv, r in items:
        out.layers.append(
            _layer_cost(rec, conv, r, bool(rec.input_requires_grad),
                        out.batch, elem_bytes, collapse_dilated))
    cls = [r for r in records
           if r.inference and is_classifier(r.path)]
    if cls:
        rec = cls[-1]
        out.classifier = _layer_cost(rec, rec.module, 1,
                                     bool(rec.input_requires_grad),
                                     out.batch, elem_bytes, collapse_dilated)
    return out


# ----------------------------------------------------------------------------
# Measured memory: what autograd keeps, GF vs vanilla on the same layers


def config_backward_cost(cfg, shape: Sequence[int], batch: int = 1,
                         radius: int = 4,
                         collapse_dilated: bool = False) -> ModelCost:
    """Build a config's model (``gradient_filter`` applied) and cost it at
    ``shape``: the per-layer numbers of ``tools/analyze_cost.py``.

    ``radius`` is the GF columns' patch size for a config without
    ``gradient_filter`` (every conv counted, see
    :func:`model_backward_cost`).
    """
    model = build_segmentor(cfg, input_size=shape)
    return model_backward_cost(model, shape, batch=batch, radius=radius,
                               collapse_dilated=collapse_dilated)


def config_step_saved_bytes(cfg, shape: Sequence[int]):
    """The whole step's analytic saved bytes
    (:func:`~mmseg_gf.analysis.step_memory.trace_step_saved_bytes`) of a
    config whose ``gradient_filter`` has the lean region on; None for any
    other config, where the count does not apply."""
    settings = cfg.get('gradient_filter')
    if not isinstance(settings, dict) or not settings.get('lean', True):
        return None
    return trace_step_saved_bytes(build_segmentor(cfg, input_size=shape),
                                  shape)


def random_batch(model: nn.Module,
                 input_size: Sequence[int],
                 batch: int = 1,
                 device='cpu',
                 seed: int = 0,
                 label_block: int = 1):
    """Random images and labels for ``model.loss``.

    Args:
        model: the segmentor (its ``decode_head.num_classes`` is used).
        input_size: ``(H, W)``.
        batch: images.
        device: where the tensors go.
        seed: of the generator (same seed, same batch).
        label_block: labels are constant on ``label_block`` pixel squares
            (1: independent per pixel; larger gives region-like maps).

    Returns:
        ``(inputs, data_samples)``.
    """
    import torch
    import torch.nn.functional as F
    from mmengine.structures import PixelData
    from mmseg.structures import SegDataSample
    h, w = (int(v) for v in input_size)
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randn(batch, 3, h, w, generator=gen).to(device)
    num_classes = int(getattr(model.decode_head, 'num_classes', 2))
    block = max(1, int(label_block))
    samples = []
    for _ in range(batch):
        coarse = torch.randint(0, num_classes,
                               (1, 1, -(-h // block), -(-w // block)),
                               generator=gen)
        labels = F.interpolate(coarse.float(), scale_factor=block,
                               mode='nearest')[0, :, :h, :w].long()
        sample = SegDataSample()
        sample.gt_sem_seg = PixelData(data=labels.to(device))
        sample.set_metainfo(
            dict(img_shape=(h, w), pad_shape=(h, w), ori_shape=(h, w)))
        samples.append(sample)
    return inputs, samples


def training_loss(model: nn.Module, inputs, data_samples):
    """``model.loss`` summed over its ``loss*`` terms, in training mode
    with frozen norms in eval mode (as GradFilterHook keeps them)."""
    from ..engine.surgery import set_frozen_norms_eval
    model.train()
    set_frozen_norms_eval(model)
    losses = model.loss(inputs, data_samples)
    return sum(v.sum() for k, v in losses.items() if 'loss' in k)


def measure_memory(cfg,
                   input_size: Sequence[int] = (64, 64),
                   batch: int = 1,
                   device: str = 'cpu',
                   modes: Sequence[str] = ('vanilla', 'gf'),
                   num_layers: Optional[int] = None,
                   radius: Any = 4) -> Dict[str, Any]:
    """Measure what the trained part keeps for backward, GF vs vanilla.

    For each mode the config's segmentor is built with its
    ``gradient_filter`` setting (or ``dict(num_layers=num_layers,
    radius=radius)`` for a config without one), ``mode`` overridden, and
    one training step (``model.loss`` on random images and labels, then
    ``backward``) is run:

    * ``saved_bytes`` per trained conv: the storages autograd packs for
      backward while that conv runs (``saved_tensors_hooks``), Parameters
      left out; the analytic count of the same conv
      (:attr:`ConvBackwardCost.vanilla_saved_bytes` /
      :attr:`~ConvBackwardCost.gf_saved_bytes`) next to it;
    * ``saved_bytes_total``: everything the forward saves, each storage
      once (frozen norms, activations, the classifier's input, ...);
    * ``peak_bytes``: the step's peak memory above what was allocated
      before it (:func:`~mmseg_gf.analysis.memory.profiled_peak_bytes`:
      CUDA ``max_memory_allocated``, CPU the profiler's live tensor bytes).

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
    import torch

    from ..engine.surgery import get_gradient_filter_layers
    from .memory import profiled_peak_bytes, saved_bytes_by_module
    settings = cfg.get('gradient_filter')
    if settings is None:
        if num_layers is None:
            raise ValueError(
                'measure_memory: the config has no gradient_filter setting; '
                'give num_layers (the last N convs to train)')
        settings = dict(num_layers=num_layers, radius=radius)
    size = tuple(int(v) for v in input_size)
    out: Dict[str, Any] = dict(input_size=list(size), batch=int(batch),
                               device=str(device))
    for mode in modes:
        run_cfg = copy.deepcopy(cfg)
        run_cfg.gradient_filter = dict(settings, mode=mode)
        torch.manual_seed(0)
        model = build_segmentor(run_cfg, input_size=size).to(device)
        cost = model_backward_cost(model, size, batch=batch)
        choices = get_gradient_filter_layers(model)
        convs = {c.path: c.module for c in choices}
        inputs, samples = random_batch(model, size, batch, device)

        def forward():
            return training_loss(model, inputs, samples)

        def step():
            model.zero_grad(set_to_none=True)
            forward().backward()

        per_layer, total = saved_bytes_by_module(
            forward, convs, exclude=list(model.parameters()))
        step()  # warm-up (lazy allocations, kernel choice)
        peak = profiled_peak_bytes(step, torch.device(device))
        layers = []
        for layer in cost.layers:
            analytic = (layer.cost.gf_saved_bytes if mode == 'gf' else
                        layer.cost.vanilla_saved_bytes)
            layers.append(dict(path=layer.path, radius=layer.radius,
                               measured=per_layer[layer.path],
                               analytic=analytic))
        out[mode] = dict(
            layers=layers,
            trained_saved_bytes=sum(x['measured'] for x in layers),
            analytic_saved_bytes=sum(x['analytic'] for x in layers),
            saved_bytes_total=total, peak_bytes=peak)
    return out
