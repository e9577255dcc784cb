"""The lean trained region on mmseg's twelve real-time families: one training
step with ``lean=True`` equals the same step with ``lean=False``.

Each family is mmseg 1.2.2's own config (:data:`mmseg_gf.engine.zoo.
REALTIME_FAMILIES`), built as a user brings it to a CPU without downloads
(:func:`mmseg_gf.engine.zoo.make_offline`: SyncBN -> BN, random weights),
at a tiny input (64x64; LRASPP 392x392, the smallest its 49x49 pool runs
at, with its MobileNetV3 tail 1/4 as wide), ``test_cfg`` mode ``'whole'``.
Random weights get a small perturbation (heads that initialise a scale to 0
would zero whole gradients) and every BN random running statistics (so a
frozen norm's scale is not 1). Batch 2, random labels in 4x4 blocks with an
ignored band (not for the families whose loss has class weights: mmseg's
cross entropy then indexes the weights with every label, 255 included),
PIDNet's boundary map from the labels.

For ``gradient_filter=dict(num_layers=5, radius=4, mode=m)`` with
``m = 'vanilla'`` and ``'gf'``, two models with the plain model's weights,
``lean=True`` and ``lean=False`` (autograd's defaults: the reference), take
one step on the same batch with the same random state (dropout, SegNeXt's
random NMF bases):

* the same trainable parameters, and the lean one does have lean modules
  (otherwise the comparison would be vacuous);
* every loss term equal (rtol 1e-5); a lean step may leave out an
  auxiliary head's term (a frozen head's loss trains nothing), no other;
* the same parameters get a gradient, each equal (rtol 1e-5, atol 1e-6 of
  the gradient's largest element).

Marked ``zoo`` like ``test_zoo_sweep.py`` (``-m "not zoo"`` deselects it).
"""
from functools import partial

import pytest

pytest.importorskip('mmseg')

from mmseg_gf.engine.build import build_segmentor  # noqa: E402
from mmseg_gf.engine.lean_region import lean_counts  # noqa: E402
from mmseg_gf.engine.zoo import (REALTIME_FAMILIES,  # noqa: E402
                                 family_config, make_offline)
from tests.helpers.devices import DEVICE_PATHS, on_path  # noqa: E402
from tests.helpers.lean_steps import check_lean_step  # noqa: E402

pytestmark = [pytest.mark.zoo, pytest.mark.usefixtures('one_thread')]

#: Input side, raised to a family's minimum (``ZooFamily.min_crop``).
SIZE = 64
BATCH = 2


def family_cfg(name: str, size: int):
    """The family's zoo config, offline, at ``size`` x ``size``."""
    cfg = make_offline(family_config(name))
    model = cfg.model
    model.data_preprocessor['size'] = (size, size)
    cfg.crop_size = (size, size)
    model.test_cfg = dict(mode='whole')
    if name == 'lraspp_mv3':  # speed at 392x392; the same layer types
        model.backbone['reduction_factor'] = 4
    return cfg


def has_class_weights(obj) -> bool:
    """Does any loss of a (nested) config have class weights?"""
    if isinstance(obj, dict):
        return obj.get('class_weight') is not None or any(
            has_class_weights(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(has_class_weights(v) for v in obj)
    return False


def filtered_model(cfg, plain, mode: str, lean: bool):
    """The config with ``gradient_filter`` built as training builds it,
    holding the plain model's weights and statistics."""
    cfg = cfg.copy()
    cfg.gradient_filter = dict(num_layers=5, radius=4, mode=mode, lean=lean)
    model = build_segmentor(cfg)
    model.load_state_dict(plain.state_dict())
    return model


@pytest.mark.parametrize('name', list(REALTIME_FAMILIES))
def test_lean_step_equals_plain_step(name):
    _check_family(name)


#: The family checked on the path CUDA tensors take and on CUDA: BiSeNetV2
#: (ReLU, max-pool, frozen BN, bilinear resizes, auxiliary heads).
DEVICE_FAMILY = 'bisenetv2'


@pytest.mark.parametrize('device_path', DEVICE_PATHS[1:])
def test_lean_step_equals_plain_step_kernels_off_and_on_cuda(device_path):
    """A real-time family's lean step with the compiled CPU kernels off
    (the path CUDA tensors take) and on CUDA."""
    with on_path(device_path) as device:
        _check_family(DEVICE_FAMILY, device, modes=('gf', ))


def _check_pair(reference, lean, mode, where):
    """The same trainable parameters, lean modules in the lean model
    only."""
    trainable = {n for n, p in lean.named_parameters() if p.requires_grad}
    assert trainable == {n for n, p in reference.named_parameters()
                         if p.requires_grad}, where
    assert sum(lean_counts(lean).values()) > 0, where
    assert not lean_counts(reference), where


def _check_family(name, device='cpu', modes=('vanilla', 'gf')):
    """:func:`check_lean_step` of one family at its size, the ignored band
    left out where its loss has class weights."""
    size = max(SIZE, REALTIME_FAMILIES[name].min_crop)
    cfg = family_cfg(name, size)
    check_lean_step(name, cfg, partial(filtered_model, cfg), size, BATCH,
                    _check_pair, device, modes,
                    ignored_band=not has_class_weights(cfg.model),
                    rtol=1e-5, atol_scale=1e-6)


def test_registry_names_each_configs_own_crop():
    for name, family in REALTIME_FAMILIES.items():
        assert tuple(family_config(name).crop_size) == family.crop, name
