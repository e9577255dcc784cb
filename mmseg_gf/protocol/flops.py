"""#Layers, radii and backward GFLOPs of a strategy, as in Tables 3 / 9.

All counts come from the shared cost model
(:func:`mmseg_gf.ops.conv.cost.conv_backward_cost`) applied to the convs
the strategy trains, with their shapes from a trace of the real model at the
config's crop size (batch 1, i.e. per image), through the model-level
:func:`mmseg_gf.analysis.model_cost.model_backward_cost` (also behind
``tools/analyze_cost.py``):

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
from typing import Any, Dict, List

from mmengine.config import Config

from ..analysis.model_cost import model_backward_cost
from ..engine.build import build_segmentor
from ..engine.config import default_input_size
from ..engine.surgery import get_gradient_filter_layers

__all__ = ['strategy_cost']


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
    model = build_segmentor(cfg)
    cost = model_backward_cost(model, size, batch=1)
    choices = get_gradient_filter_layers(model)
    # 'all' (no gradient_filter) is the exact backward: 'vanilla' here.
    mode = 'gf' if cost.mode == 'gf' else 'vanilla'
    per_layer: List[Dict[str, Any]] = [
        dict(path=layer.path,
             radius=layer.radius if mode == 'gf' else None,
             gflops=cost.layer_flops(layer) / 1e9) for layer in cost.layers
    ]
    layers: Any = 'All' if choices is None else len(choices)
    if mode == 'gf':
        radius = '/'.join(str(r) for r in sorted({c.radius
                                                  for c in choices}))
    else:
        radius = '-'
    return dict(layers=layers, radius=radius, mode=mode,
                gflops=cost.flops / 1e9, input_size=size,
                per_layer=per_layer)
