"""A layer kind registered in this file alone: ``nn.Conv1d`` over a token
sequence, gradient-filtered along its one axis. Nothing else in the
package names it, and it is

* filtered as docs/gradient_filter.md restricts to one axis: ``g_y``
  replaced by its means over patches of ``r`` positions along the length,
  the kernel summed over its taps, ``g_W`` from the patch means times the
  patch sums of the input (checked against a hand-written 1-D reference
  and the float64 loop reference of ``tests/helpers/gf_reference.py`` on a
  one-row map);
* selected: ``layer_kinds=['conv1d']`` counts the 1-D convs only;
* swapped in by the surgery, and its filter acts;
* counted: the step trace models every byte the filtered 1-D convs keep
  (the analytic total equals autograd's saved bytes), the cost report
  counts them with the 1-D formulas, the launch count files them under
  ``filtered_conv``;
* budgeted: a budget over ``layer_kinds=['conv1d']`` chooses among them.

The filtered module runs the 2-D operator on a one-row map: a map of one
row is one patch row whatever ``r`` (docs/gradient_filter.md#partial-
patches), so its patches are ``1 x r`` and every formula reduces to the
length axis. A tiny EncoderDecoder (a stem conv, then two 1-D convs over
the map's pixels as one sequence; FCN head), 32x32, batch 2, float32.
"""
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip('mmseg')

from mmengine.model import BaseModule  # noqa: E402
from mmseg.registry import MODELS  # noqa: E402

from mmseg_gf.accounting.batch import random_batch, training_loss  # noqa
from mmseg_gf.accounting.kept import SavedItem, conv_items  # noqa: E402
from mmseg_gf.accounting.kept import count_once  # noqa: E402
from mmseg_gf.accounting.launches import module_kind  # noqa: E402
from mmseg_gf.accounting.measured import saved_tensor_bytes  # noqa: E402
from mmseg_gf.accounting.saved_bytes import trace_step_saved_bytes  # noqa: E402
from mmseg_gf.analysis.model_cost import model_backward_cost  # noqa: E402
from mmseg_gf.engine.config import (check_settings,  # noqa: E402
                                    select_and_apply)
from mmseg_gf.engine.selection import select_layers  # noqa: E402
from mmseg_gf.models.filtered_layer import FilteredLayer  # noqa: E402
from mmseg_gf.models.layer_kinds import (LayerKind,  # noqa: E402
                                         layer_kernels,
                                         register_layer_kind,
                                         unregister_layer_kind)
from mmseg_gf.models.gf_conv import sharing_conv  # noqa: E402
from mmseg_gf.ops.conv.cost import ConvGeometry  # noqa: E402
from mmseg_gf.ops.conv.function import gradient_filtered_conv2d  # noqa
from mmseg_gf.models.gradient_quality import model_dc_energy_ratio  # noqa: E402
from tests.helpers.gf_reference import reference_gradients  # noqa: E402
from tests.helpers.tiny_segmentors import fcn_head  # noqa: E402
from tests.helpers.tiny_segmentors import tiny_segmentor  # noqa: E402

SIZE = (32, 32)
BATCH = 2
LENGTH = 16 * 16  # the stem's 16x16 map as one sequence
SEQUENCE = ['backbone.seq1', 'backbone.seq2']

pytestmark = pytest.mark.usefixtures('one_thread')


class GFConv1d(FilteredLayer, nn.Conv1d):
    """An ``nn.Conv1d`` whose backward filters ``g_y`` in patches of ``r``
    positions along the length (zero padding of numbers; other calls run
    the exact backward)."""

    @classmethod
    def from_plain(cls, conv: nn.Conv1d, radius: int,
                   enabled: bool = True) -> 'GFConv1d':
        """The filtered layer of ``conv``, sharing its Parameters."""
        return sharing_conv(cls, conv, radius, enabled)

    def _conv_forward(self, input, weight, bias):
        if (not self._filter_active(input, weight, bias)
                or input.dim() != 3 or input.numel() == 0
                or self.padding_mode != 'zeros'
                or isinstance(self.padding, str)):
            return super()._conv_forward(input, weight, bias)
        # the length axis as the width of a one-row map
        return gradient_filtered_conv2d(
            input.unsqueeze(2), weight.unsqueeze(2), bias,
            (1, self.stride[0]), (0, self.padding[0]),
            (1, self.dilation[0]), self.groups, self.radius).squeeze(2)


@dataclass(frozen=True)
class SequenceGeometry(ConvGeometry):
    """A 1-D conv's geometry as a 2-D conv's on a one-row map: its cost
    follows (``ceil(1/r) = 1`` patch row); its table cell is the length
    axis's."""

    def describe(self) -> str:
        return (f'{self.kernel_size[1]}/{self.stride[1]}/{self.dilation[1]}'
                f'/{self.groups}')


def _geometry(conv: nn.Module, inputs, output) -> SequenceGeometry:
    (cin, length), (cout, out_length) = inputs[0].shape[1:], output.shape[1:]
    return SequenceGeometry((cin, 1, length), (cout, 1, out_length),
                            (1, conv.kernel_size[0]), (1, conv.stride[0]),
                            (1, conv.dilation[0]), conv.groups)


def _kept(path, module, x, out, shared):
    """The conv kind's rule (patch sums of the input, or the input), plus
    the view of the weight (one row added) the filtered call keeps, once
    per weight at any batch."""
    items = conv_items(path, module, x, out, shared)
    if isinstance(module, GFConv1d) and module._filter_active(x):
        storage = module.weight.untyped_storage()
        if count_once(shared, path, storage.data_ptr(), storage):
            items.append(SavedItem(
                path, 'conv', module.weight.numel(),
                module.weight.element_size(), 'const',
                storage=storage.data_ptr()))
    return items


def _no_quality(conv, x, grad_out, radius):
    raise NotImplementedError('no gradient quality for a 1-D conv here')


KIND = LayerKind(
    name='conv1d', noun='1-D conv', traced_type=nn.Conv1d,
    plain_types=(nn.Conv1d, ), filtered_type=GFConv1d,
    from_plain=GFConv1d.from_plain, geometry=_geometry, quality=_no_quality,
    allowed='nn.Conv1d (GFConv1d)', kept_rule=_kept,
    family=nn.modules.conv._ConvNd, category='conv',
    kernel=lambda conv: conv.weight)


@pytest.fixture
def conv1d_kind():
    register_layer_kind(KIND)
    yield KIND
    unregister_layer_kind(KIND.name)


@MODELS.register_module(force=True)
class SequenceTestBackbone(BaseModule):
    """A stem conv, then two 1-D convs over its map's pixels read as one
    sequence; each conv then a ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.seq1 = nn.Conv1d(8, 8, 3, padding=1)
        self.seq2 = nn.Conv1d(8, 16, 5, padding=2)
        self.relus = nn.ModuleList([nn.ReLU() for _ in range(3)])

    def forward(self, x):
        x = self.relus[0](self.stem(x))
        n, _, h, w = x.shape
        x = x.flatten(2)
        x = self.relus[2](self.seq2(self.relus[1](self.seq1(x))))
        return [x.view(n, -1, h, w)]


def _model():
    return tiny_segmentor('SequenceTestBackbone', SIZE, fcn_head(16, 8))


# --- the filter: docs/gradient_filter.md along one axis -----------------

def _one_axis_reference(x, weight, grad_out, radius):
    """Stride 1, ``padding = (k - 1) // 2``, odd ``k``, one group: the
    input patch of output patch ``P`` is ``[P r, (P+1) r)``; float64."""
    x, weight, grad_out = x.double(), weight.double(), grad_out.double()
    length = grad_out.shape[-1]
    patches = [(p, min(p + radius, length))
               for p in range(0, length, radius)]
    taps = weight.sum(-1)  # W~[co, ci]
    g_x = torch.zeros_like(x)
    g_w = torch.zeros_like(weight)
    for start, end in patches:
        mean = grad_out[..., start:end].mean(-1)  # g~[n, co]
        g_x[..., start:end] = (mean @ taps)[..., None]
        summed = x[..., start:end].sum(-1)  # x~[n, ci]
        g_w += (mean.t() @ summed)[..., None]
    return g_x, g_w


def _filtered_grads(conv, x, grad_out):
    x = x.detach().requires_grad_()
    conv.zero_grad(set_to_none=True)
    out = conv(x)
    out.backward(grad_out)
    return out, x.grad, conv.weight.grad, conv.bias.grad


@pytest.mark.parametrize('length,kernel,radius', [(20, 3, 4), (17, 5, 3),
                                                  (6, 3, 8)])
def test_filter_is_the_one_axis_formula(length, kernel, radius):
    torch.manual_seed(0)
    plain = nn.Conv1d(3, 4, kernel, padding=(kernel - 1) // 2)
    conv = GFConv1d.from_plain(plain, radius)
    x = torch.randn(2, 3, length)
    grad_out = torch.randn(2, 4, length)
    out, g_x, g_w, g_b = _filtered_grads(conv, x, grad_out)
    assert torch.equal(out, F.conv1d(x, plain.weight, plain.bias,
                                     padding=plain.padding))
    want_x, want_w = _one_axis_reference(x, plain.weight.detach(),
                                         grad_out, radius)
    torch.testing.assert_close(g_x.double(), want_x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_w.double(), want_w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_b, grad_out.sum((0, 2)))
    assert not torch.allclose(g_w, _exact_weight_grad(plain, x, grad_out))


def _exact_weight_grad(conv, x, grad_out):
    conv.zero_grad(set_to_none=True)
    conv(x).backward(grad_out)
    return conv.weight.grad


@pytest.mark.parametrize('stride,padding,dilation,groups', [
    (2, 1, 1, 1), (1, 4, 2, 1), (1, 1, 1, 2), (3, 0, 1, 1)])
def test_filter_matches_the_reference_on_a_one_row_map(
        stride, padding, dilation, groups):
    torch.manual_seed(0)
    plain = nn.Conv1d(4, 6, 3, stride, padding, dilation, groups)
    conv = GFConv1d.from_plain(plain, 2)
    x = torch.randn(2, 4, 19)
    out_length = plain(x).shape[-1]
    grad_out = torch.randn(2, 6, out_length)
    _, g_x, g_w, _ = _filtered_grads(conv, x, grad_out)
    want_x, want_w, _ = reference_gradients(
        x.unsqueeze(2), plain.weight.detach().unsqueeze(2),
        grad_out.unsqueeze(2), (1, stride), (0, padding), (1, dilation),
        groups, 2)
    torch.testing.assert_close(g_x.double(), want_x.squeeze(2), rtol=1e-5,
                               atol=1e-5)
    torch.testing.assert_close(g_w.double(), want_w.squeeze(2), rtol=1e-5,
                               atol=1e-5)


# --- the kind through the plugin ----------------------------------------

def test_selected_as_a_kind(conv1d_kind):
    model = _model()
    chosen = select_layers(model, num_layers=2, layer_kinds=['conv1d'],
                           radius=4, input_size=SIZE)
    assert [(c.path, c.kind, c.in_shape) for c in chosen] == [
        ('backbone.seq1', 'conv1d', (8, 1, LENGTH)),
        ('backbone.seq2', 'conv1d', (8, 1, LENGTH))]
    convs = select_layers(model, num_layers=2, layer_kinds=['conv2d'],
                          radius=4, input_size=SIZE)
    assert [c.path for c in convs] == ['backbone.stem',
                                       'decode_head.convs.0.conv']


def _filtered(**settings):
    model = _model()
    choices = select_and_apply(model, check_settings(dict(
        layer_kinds=['conv1d'], **settings)), SIZE, batch=BATCH)
    return model, choices


def _weight_grads(model, batch):
    model.zero_grad(set_to_none=True)
    training_loss(model, *batch).backward()
    return [model.get_submodule(p).weight.grad.clone() for p in SEQUENCE]


def test_filtered_and_every_kept_byte_counted(conv1d_kind):
    model, choices = _filtered(num_layers=2, radius=4)
    assert [c.path for c in choices] == SEQUENCE
    assert all(isinstance(c.module, GFConv1d) for c in choices)
    assert all(module_kind(c.module) == 'filtered_conv' for c in choices)
    batch = random_batch(model, SIZE, BATCH)
    got = _weight_grads(model, batch)
    counted = trace_step_saved_bytes(model, SIZE)
    assert not set(counted.unmodelled) & set(SEQUENCE), counted.unmodelled
    for path in SEQUENCE:
        conv = model.get_submodule(path)
        items = [(i.elements, i.rule) for i in counted.items
                 if i.path == path]
        # the patch sums of the input (8 channels, ceil(256 / 4) patches),
        # not the input; and the weight's view
        assert sorted(items) == sorted([
            (8 * math.ceil(LENGTH / 4), 'linear'),
            (conv.weight.numel(), 'const')])
    assert counted.total(BATCH) == saved_tensor_bytes(
        lambda: training_loss(model, *batch)), counted.summary(BATCH)
    for c in choices:
        c.module.enabled = False
    exact = _weight_grads(model, batch)
    assert not any(torch.allclose(g, e) for g, e in zip(got, exact))


def test_costed_with_the_one_axis_formulas(conv1d_kind):
    model, _ = _filtered(num_layers=2, radius=4)
    cost = model_backward_cost(model, SIZE)
    patches = math.ceil(LENGTH / 4)
    layers = {c.path: c for c in cost.layers}
    assert sorted(layers) == SEQUENCE
    for path, (cin, cout, k) in zip(SEQUENCE, [(8, 8, 3), (8, 16, 5)]):
        assert layers[path].describe == f'{k}/1/1/1'
        c = layers[path].cost
        assert c.vanilla_saved_bytes == 4 * cin * LENGTH
        assert c.gf_saved_bytes == 4 * cin * patches
        assert c.vanilla_grad_weight_flops == 2 * cout * LENGTH * cin * k
        # the kernel collapses to one tap on the patch grid
        assert c.gf_grad_weight_flops == 2 * cout * cin * patches
    # the stem's input is the image: the first 1-D conv computes no g_x
    assert layers[SEQUENCE[0]].cost.gf_grad_input_flops == 0
    assert layers[SEQUENCE[1]].cost.gf_grad_input_flops > 0


def test_budgeted_among_the_kind(conv1d_kind):
    # the step peak runs each candidate's filtered backward alone on its
    # traced input's shape (the backward's scratch)
    model, choices = _filtered(budget=dict(saved_mib=64, peak_mib=64,
                                           radii=[2, 4]))
    assert choices and all(c.kind == 'conv1d' and isinstance(
        c.module, GFConv1d) for c in choices)
    assert [c.path for c in choices] == SEQUENCE[-len(choices):]


def test_kernels_reach_the_dc_energy_ratio(conv1d_kind):
    model = _model()
    with torch.no_grad():
        model.backbone.seq1.weight.copy_(torch.tensor([1., 2., 1.]))
    ratios = model_dc_energy_ratio(layer_kernels(model))
    # 1-D DFT of (1, 2, 1): DC 4, |1 + 2w + w^2| = 1 at the other two
    assert ratios['backbone.seq1'] == pytest.approx(16.0)
    assert {'backbone.stem', 'backbone.seq2'} < set(ratios)
