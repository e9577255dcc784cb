"""The lean region inside transformer blocks, on mmseg's own configs.

Segformer (MiT), Twins-PCPVT UPerNet and Swin UPerNet from mmseg 1.2.2's
zoo (:data:`mmseg_gf.engine.zoo.ZOO_FAMILIES`), offline, shrunk to a few
channels and one or two blocks per stage (:func:`tiny_cfg`), at 64x64,
batch 2, with their DropPath rates as configured. GF last 20 convs
(``layer_kinds=['conv2d']``; Swin: every conv it has, the head's and the
patch embedding's) reaches convs inside (or, Swin, before) the blocks, so the frozen attention, LayerNorm, GELU
and DropPath lie on the gradient path:

* a step with ``lean=True`` equals the same step with ``lean=False``
  (``vanilla`` and ``gf``): loss terms within rtol 1e-5, every gradient
  within rtol 1e-4, atol 1e-5 of its largest element (the attention sums
  in another order through SDPA, at every block the gradient crosses);
* the step trace counts every byte by rule: nothing is "unmodelled", and
  the count equals autograd's saved bytes of a real step (Segformer's
  Mix-FFN GELUs keeping patch means of their derivative among them);
* the budget's profile predicts the saved bytes and the step peak of
  last 5, 10 and 20 within 10% with the patch-mean GELU rule on (it picks
  the very GELUs the trained model's traced step does), and the saved
  bytes of last 20 within 10% with the rule off
  (``patch_mean_activations=False``: every GELU keeps its input);
* with every layer kind trained (``layer_kinds=None``: the filtered
  Linears, attentions and patch-mean GELUs beside the convs), Segformer's
  and Swin's ``gf`` lean step equals its ``lean=False`` step with the
  compiled CPU kernels off (the path CUDA tensors take) and on CUDA
  (``pytest -m cuda``), float32, the tolerances above.
"""
import copy
from functools import partial

import pytest

pytest.importorskip('mmseg')

from mmseg_gf.accounting.saved_bytes import trace_step_saved_bytes  # noqa: E402
from mmseg_gf.analysis.budget_sweep import measured_step_peak  # noqa: E402
from mmseg_gf.engine.budget import profile_segmentor  # noqa: E402
from mmseg_gf.engine.build import build_segmentor  # noqa: E402
from mmseg_gf.engine.lean_region import lean_counts  # noqa: E402
from mmseg_gf.engine.state import get_state  # noqa: E402
from mmseg_gf.engine.zoo import family_config, make_offline  # noqa: E402
from tests.helpers.devices import DEVICE_PATHS, on_path  # noqa: E402
from tests.helpers.engine_fixtures import step_saved_bytes  # noqa: E402
from tests.helpers.lean_steps import (check_lean_step,  # noqa: E402
                                      plain_model)

pytestmark = [pytest.mark.zoo, pytest.mark.usefixtures('one_thread')]

SIZE = 64
BATCH = 2
CLASSES = 5
FAMILIES = ('segformer_b0', 'twins_pcpvt_s', 'swin_t')


def tiny_cfg(name: str):
    """The family's zoo config, offline, shrunk, at 64x64."""
    cfg = make_offline(family_config(name))
    model = cfg.model
    model.data_preprocessor['size'] = (SIZE, SIZE)
    cfg.crop_size = (SIZE, SIZE)
    model.test_cfg = dict(mode='whole')
    backbone, head = model.backbone, model.decode_head
    if name.startswith('segformer'):
        backbone.update(embed_dims=8, num_heads=[1, 2, 2, 4],
                        num_layers=[1, 1, 1, 1] if name == 'segformer_b0'
                        else [2, 1, 2, 1])
        head.update(in_channels=[8, 16, 16, 32], channels=16)
    elif name.startswith('twins'):
        backbone.update(embed_dims=[8, 16, 16, 32], num_heads=[1, 2, 2, 4],
                        mlp_ratios=[2, 2, 2, 2], depths=[1, 1, 1, 1])
        head.update(in_channels=[8, 16, 16, 32], channels=16)
        model.auxiliary_head.update(in_channels=16, channels=8)
    elif name.startswith('swin'):
        backbone.update(embed_dims=8, depths=[2, 2, 2, 2],
                        num_heads=[1, 2, 2, 4], window_size=4)
        head.update(in_channels=[8, 16, 32, 64], channels=16)
        model.auxiliary_head.update(in_channels=32, channels=8)
    head.num_classes = CLASSES
    if 'auxiliary_head' in model and model.auxiliary_head is not None:
        model.auxiliary_head.num_classes = CLASSES
    return cfg


def _layers(name: str) -> int:
    # Swin has 13 convs (the head's 12 and the patch embedding)
    return 13 if name.startswith('swin') else 20


def _model(cfg, plain, mode, lean, layers, patch_mean_activations=True,
           layer_kinds=('conv2d', )):
    cfg = cfg.copy()
    # convs only: the frozen blocks' attention, LayerNorm and GELU stay on
    # the gradient path (every kind: test_token_kinds_accounting.py)
    cfg.gradient_filter = dict(
        num_layers=layers, radius=4, mode=mode, lean=lean,
        layer_kinds=None if layer_kinds is None else list(layer_kinds),
        patch_mean_activations=patch_mean_activations)
    model = build_segmentor(cfg)
    model.load_state_dict(plain.state_dict())
    return model


@pytest.mark.parametrize('name', FAMILIES)
def test_lean_step_equals_plain_step(name):
    _check_family(name)


#: The families checked with every layer kind trained, on the path CUDA
#: tensors take and on CUDA.
DEVICE_FAMILIES = ('segformer_b0', 'swin_t')


@pytest.mark.parametrize('device_path', DEVICE_PATHS[1:])
@pytest.mark.parametrize('name', DEVICE_FAMILIES)
def test_lean_step_equals_plain_step_kernels_off_and_on_cuda(name,
                                                             device_path):
    """Filtered Linears and attentions, patch-mean GELUs, the lean
    LayerNorm / SDPA / DropPath: the compiled CPU kernels off, and CUDA."""
    with on_path(device_path) as device:
        _check_family(name, device, modes=('gf', ), layer_kinds=None)


def _check_family(name, device='cpu', modes=('vanilla', 'gf'),
                  layer_kinds=('conv2d', )):
    """:func:`check_lean_step` of one family: the lean attention and
    LayerNorm (with every layer kind and ``gf``, the patch-mean GELUs)
    in the lean model, rtol 1e-4, atol 1e-5 of each gradient's largest
    element."""
    # every kind: Swin's last 20 reach the MLPs of its last two stages
    layers = 20 if layer_kinds is None else _layers(name)

    def check_pair(reference, lean, mode, where):
        counts = lean_counts(lean)
        assert counts.get('attention') and counts.get('layer_norm'), counts
        if layer_kinds is None and mode == 'gf':
            assert counts.get('patch_mean_gelu'), counts

    cfg = tiny_cfg(name)
    check_lean_step(name, cfg,
                    partial(_model, cfg, layers=layers,
                            layer_kinds=layer_kinds),
                    SIZE, BATCH, check_pair, device, modes, rtol=1e-4,
                    atol_scale=1e-5)


def _measured(model, batch=BATCH):
    return step_saved_bytes(model, (SIZE, SIZE), batch)


@pytest.mark.parametrize('name', FAMILIES + ('segformer_b2', ))
def test_every_byte_is_counted_by_rule(name):
    cfg = tiny_cfg(name)
    plain = plain_model(cfg)
    model = _model(cfg, plain, 'gf', True, _layers(name))
    if name.startswith('segformer'):  # Mix-FFN GELUs between GF convs
        assert get_state(model).patch_mean_gelus
    counted = trace_step_saved_bytes(model, (SIZE, SIZE))
    assert counted.unmodelled_bytes(BATCH) == {}, counted.summary(BATCH)
    by_category = counted.by_category(BATCH)
    assert by_category['attention'] > 0 and by_category['norm'] > 0
    assert counted.total(BATCH) == _measured(model), counted.summary(BATCH)


@pytest.mark.parametrize('name', ('segformer_b0', 'twins_pcpvt_s'))
def test_budget_profile_predicts_saved_bytes_and_peak(name):
    cfg = tiny_cfg(name)
    plain = plain_model(cfg)
    probe = copy.deepcopy(plain)
    profile = profile_segmentor(probe, (SIZE, SIZE), timeline=True,
                                layer_kinds=['conv2d'])
    assert profile.unmodelled(20) == []
    for layers in (5, 10, 20):
        cost = profile.cost(layers, 4, BATCH)
        model = _model(cfg, plain, 'gf', True, layers)
        assert sorted(profile.patch_mean_gelus(layers, 4)) == \
            get_state(model).patch_mean_gelus, layers
        measured = _measured(model)
        assert abs(cost.saved_bytes / measured - 1) <= 0.10, (
            layers, cost.saved_bytes, measured)
        peak = measured_step_peak(model, (SIZE, SIZE), BATCH)
        assert abs(cost.peak_bytes / peak - 1) <= 0.10, (
            layers, cost.peak_bytes, peak)
    if name.startswith('segformer'):  # Mix-FFN GELUs between GF convs
        assert profile.patch_mean_gelus(20, 4)
    # the rule off: every GELU counted by its input
    off = profile_segmentor(copy.deepcopy(plain), (SIZE, SIZE),
                            layer_kinds=['conv2d'],
                            patch_mean_activations=False)
    assert off.patch_mean_gelus(20, 4) == {}
    cost = off.cost(20, 4, BATCH)
    measured = _measured(_model(cfg, plain, 'gf', True, 20,
                                patch_mean_activations=False))
    assert abs(cost.saved_bytes / measured - 1) <= 0.10, (
        cost.saved_bytes, measured)
