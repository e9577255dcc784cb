"""A layer kind registered in this file alone: depthwise convs as a kind of
their own beside ``conv2d`` (``LayerKind.claims``), with a filtered module
of their own. Nothing else in the package names it, and it is

* selected: ``layer_kinds=['depthwise']`` counts the depthwise convs only,
  ``['conv2d']`` the others;
* filtered: the surgery swaps in the kind's module, whose filter acts;
* counted: the step trace models every byte the filtered depthwise convs
  keep (the analytic total equals autograd's saved bytes);
* budgeted: a budget over ``layer_kinds=['depthwise']`` chooses among them.

A tiny EncoderDecoder (stem conv, depthwise, pointwise, depthwise; FCN
head), 32x32, batch 2, float32.
"""
import pytest
import torch
from torch import nn

pytest.importorskip('mmseg')

from mmengine.model import BaseModule  # noqa: E402
from mmseg.registry import MODELS  # noqa: E402

from mmseg_gf.accounting.batch import random_batch, training_loss  # noqa
from mmseg_gf.accounting.measured import saved_tensor_bytes  # noqa: E402
from mmseg_gf.accounting.saved_bytes import trace_step_saved_bytes  # noqa: E402
from mmseg_gf.engine.config import (check_settings,  # noqa: E402
                                    select_and_apply)
from mmseg_gf.engine.selection import select_layers  # noqa: E402
from mmseg_gf.models.gf_conv import GFConv2d  # noqa: E402
from mmseg_gf.models.layer_kinds import (CONV2D, LayerKind,  # noqa: E402
                                         register_layer_kind,
                                         unregister_layer_kind)
from tests.helpers.tiny_segmentors import fcn_head, tiny_segmentor  # noqa: E402

SIZE = (32, 32)
BATCH = 2
DEPTHWISE = ['backbone.dw1', 'backbone.dw2']

pytestmark = pytest.mark.usefixtures('one_thread')


class GFDepthwiseConv2d(GFConv2d):
    """The depthwise kind's filtered module (the conv's filter)."""


def _is_depthwise(conv: nn.Module) -> bool:
    return conv.groups > 1 and \
        conv.groups == conv.in_channels == conv.out_channels


def _from_plain(conv: nn.Module, radius: int,
                enabled: bool) -> GFDepthwiseConv2d:
    return GFDepthwiseConv2d.from_conv(conv, radius, enabled=enabled)


KIND = LayerKind(
    name='depthwise', noun='depthwise conv', traced_type=nn.Conv2d,
    plain_types=CONV2D.plain_types, filtered_type=GFDepthwiseConv2d,
    from_plain=_from_plain, geometry=CONV2D.geometry, quality=CONV2D.quality,
    allowed='a depthwise nn.Conv2d (GFDepthwiseConv2d)',
    patch_partitioned=True, kept_rule=CONV2D.kept_rule,
    frozen_lean=CONV2D.frozen_lean, claims=_is_depthwise,
    family=CONV2D.family, category=CONV2D.category, kernel=CONV2D.kernel)


@pytest.fixture
def depthwise_kind():
    register_layer_kind(KIND)
    yield KIND
    unregister_layer_kind(KIND.name)


@MODELS.register_module(force=True)
class DepthwiseTestBackbone(BaseModule):
    """Stem, depthwise, pointwise, depthwise; each conv then a ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.dw1 = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.pw = nn.Conv2d(8, 16, 1)
        self.dw2 = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.relus = nn.ModuleList([nn.ReLU() for _ in range(4)])

    def forward(self, x):
        for conv, relu in zip((self.stem, self.dw1, self.pw, self.dw2),
                              self.relus):
            x = relu(conv(x))
        return [x]


def _model():
    return tiny_segmentor('DepthwiseTestBackbone', SIZE, fcn_head(16, 8))


def test_selected_as_a_kind_of_their_own(depthwise_kind):
    model = _model()
    chosen = select_layers(model, num_layers=2, layer_kinds=['depthwise'],
                           radius=2, input_size=SIZE)
    assert [(c.path, c.kind) for c in chosen] == [
        (p, 'depthwise') for p in DEPTHWISE]
    convs = select_layers(model, num_layers=3, layer_kinds=['conv2d'],
                          radius=2, input_size=SIZE)
    assert [c.path for c in convs] == [
        'backbone.stem', 'backbone.pw', 'decode_head.convs.0.conv']


def _filtered(**settings):
    model = _model()
    choices = select_and_apply(model, check_settings(dict(
        layer_kinds=['depthwise'], **settings)), SIZE, batch=BATCH)
    return model, choices


def _weight_grads(model, batch):
    model.zero_grad(set_to_none=True)
    training_loss(model, *batch).backward()
    return [model.get_submodule(p).weight.grad.clone() for p in DEPTHWISE]


def test_filtered_and_every_kept_byte_counted(depthwise_kind):
    model, choices = _filtered(num_layers=2, radius=2)
    assert all(isinstance(c.module, GFDepthwiseConv2d) for c in choices)
    batch = random_batch(model, SIZE, BATCH)
    got = _weight_grads(model, batch)
    counted = trace_step_saved_bytes(model, SIZE)
    items = {i.path: i for i in counted.items if i.path in DEPTHWISE}
    assert sorted(items) == DEPTHWISE
    # the patch sums of the input, not the input
    assert all(items[p].category == 'conv' and items[p].elements <
               model.get_submodule(p).in_channels * 16 * 16
               for p in DEPTHWISE)
    assert counted.total(BATCH) == saved_tensor_bytes(
        lambda: training_loss(model, *batch)), counted.summary(BATCH)
    for c in choices:
        c.module.enabled = False
    exact = _weight_grads(model, batch)
    assert not any(torch.allclose(g, e) for g, e in zip(got, exact))


def test_budgeted_among_the_kind(depthwise_kind):
    model, choices = _filtered(budget=dict(saved_mib=64, radii=[2, 4]))
    assert choices and all(c.kind == 'depthwise' and isinstance(
        c.module, GFDepthwiseConv2d) for c in choices)
    assert [c.path for c in choices] == DEPTHWISE[-len(choices):]
