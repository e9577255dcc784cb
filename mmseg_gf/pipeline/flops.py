"""#Layers, radii and backward GFLOPs of a strategy, as in Tables 3 / 9.

All counts come from the shared cost model
(:func:`mmseg_gf.analysis.cost.conv_backward_cost`) applied to the convs
the strategy trains, with their shapes from a trace of the real model at the
config's crop size (batch 1, i.e. per image):

* gradient-filter strategies (``mode='gf'``): the filtered backward of the
  chosen convs (``gf_flops``: ``g_x`` where the conv's input needs a
  gradient, ``g_W``, the patch-mean overheads);
* "Vanilla BP N" (``mode='vanilla'``): the exact backward of the same convs;
* "Vanilla BP All" (no ``gradient_filter``): the exact backward of every
  conv on the inference path (the first conv needs no ``g_x``);
* calibration: 0 layers, 0 FLOPs.

The classifier (``decode_head.conv_seg``, trained by every strategy, also by
calibration) is not counted, as in the paper, where "Calibration" is 0
GFLOPs and "#Layers" counts the other trained convs. Frozen convs between
trained ones (e.g. DeepLabV3's image-pool branch under the reference choice)
only pass ``g_x`` through and are not counted either.
"""
import copy
from typing import Any, Dict, List

from mmengine.config import Config

from ..analysis.cost import conv_backward_cost
from ..engine.config import default_input_size, rewrite_config
from ..engine.selection import CLASSIFIER_SUFFIX, trace_convs
from ..engine.surgery import MODE_ATTR, get_gradient_filter_layers

__all__ = ['strategy_cost']


def _pair(v):
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _is_classifier(path: str) -> bool:
    return path.split('.')[-1] == CLASSIFIER_SUFFIX


def strategy_cost(cfg: Config, kind: str = 'finetune') -> Dict[str, Any]:
    """Describe what a run's config trains and what its backward costs.

    Args:
        cfg: the run config (before :func:`rewrite_config`; not modified).
        kind: ``'calib'`` for the calibration stage. A finetuning config
            with a ``CalibrationHook`` (``classifier_only``) trains no
            counted conv either: mode ``'classifier'``, 0 layers.

    Returns:
        dict with ``layers`` (int, or ``'All'``), ``radius`` (``'-'``, ``'4'``
        or e.g. ``'2/3/6/9'``), ``mode`` (``'calib'``, ``'vanilla'``,
        ``'gf'``), ``gflops`` (float), ``input_size`` ``[H, W]`` and
        ``per_layer`` (path, radius, GFLOPs).
    """
    size = [int(v) for v in default_input_size(cfg)]
    frozen = any(h.get('type') == 'CalibrationHook'
                 for h in cfg.get('custom_hooks') or [])
    if kind == 'calib' or frozen:
        # The classifier (decoder for MobileNetV2 calibration) only.
        return dict(layers=0, radius='-',
                    mode='calib' if kind == 'calib' else 'classifier',
                    gflops=0.0, input_size=size, per_layer=[])
    from mmseg.registry import MODELS
    from mmseg.utils import register_all_modules
    register_all_modules(init_default_scope=False)
    cfg = copy.deepcopy(cfg)
    rewrite_config(cfg)
    model = MODELS.build(cfg.model)
    records = trace_convs(model, size, grad=True)
    needs = {r.path: r.input_requires_grad for r in records}
    choices = get_gradient_filter_layers(model)
    per_layer: List[Dict[str, Any]] = []
    total = 0
    if choices is None:
        mode = 'vanilla'
        items = [(r.path, r.module, r.in_shape, r.out_shape, 1)
                 for r in records
                 if r.inference and not _is_classifier(r.path)]
    else:
        mode = getattr(model, MODE_ATTR, 'gf')
        items = [(c.path, c.module, c.in_shape, c.out_shape, c.radius)
                 for c in choices]
    for path, conv, in_shape, out_shape, radius in items:
        kh, kw = _pair(conv.kernel_size)
        cost = conv_backward_cost(
            cin=in_shape[0], cout=out_shape[0], kh=kh, kw=kw,
            stride=conv.stride, dilation=conv.dilation, groups=conv.groups,
            in_hw=in_shape[1:], out_hw=out_shape[1:], batch=1,
            radius=radius, need_input_grad=bool(needs.get(path, True)))
        flops = cost.gf_flops if mode == 'gf' else cost.vanilla_flops
        total += flops
        per_layer.append(
            dict(path=path, radius=radius if mode == 'gf' else None,
                 gflops=flops / 1e9))
    if choices is None:
        layers: Any = 'All'
    else:
        layers = len(choices)
    if mode == 'gf':
        radii = sorted({c.radius for c in choices})
        radius = '/'.join(str(r) for r in radii)
    else:
        radius = '-'
    return dict(layers=layers, radius=radius, mode=mode, gflops=total / 1e9,
                input_size=size, per_layer=per_layer)
