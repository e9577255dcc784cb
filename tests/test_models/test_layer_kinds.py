"""The layer-kind registry (mmseg_gf.models.layer_kinds): Conv2d is the
first kind, and its description gives what the selection, surgery and the
accounting used to compute from ``nn.Conv2d`` / ``GFConv2d`` directly."""
import pytest
import torch
from torch import nn

from mmseg_gf.models import GFConv2d
from mmseg_gf.models.layer_kinds import (CONV2D, LayerKind, family_kind_of,
                                         filterable_names, is_filterable,
                                         is_filtered, kind_of, layer_kernels,
                                         layer_kind, layer_kinds,
                                         register_layer_kind, traced_kind_of,
                                         traced_type_names)
from mmseg_gf.ops.conv.cost import ConvGeometry


class _ConvWS(nn.Conv2d):
    """A conv subclass with its own forward (weight standardisation)."""

    def forward(self, x):
        w = self.weight - self.weight.mean(dim=(1, 2, 3), keepdim=True)
        return self._conv_forward(x, w, self.bias)


def test_conv2d_is_the_first_kind():
    assert layer_kinds()[0] is CONV2D is layer_kind('conv2d')
    assert traced_type_names().startswith('nn.Conv2d')
    assert 'nn.Conv2d' in filterable_names()
    with pytest.raises(KeyError, match="no layer kind 'conv3d'"):
        layer_kind('conv3d')


def test_which_modules_the_conv_kind_takes():
    conv = nn.Conv2d(3, 4, 3)
    assert kind_of(conv) is CONV2D and is_filterable(conv)
    assert not is_filtered(conv)
    gf = GFConv2d(3, 4, 3, radius=2)
    assert kind_of(gf) is CONV2D and is_filtered(gf)
    # traced (so that selection can name it) but not filterable
    ws = _ConvWS(3, 4, 3)
    assert traced_kind_of(ws) is CONV2D and kind_of(ws) is None
    for other in (nn.ConvTranspose2d(3, 4, 3), nn.Conv1d(3, 4, 3)):
        assert traced_kind_of(other) is None and kind_of(other) is None
    # a Linear is the next kind's, not the conv's
    linear = nn.Linear(3, 4)
    assert kind_of(linear) is layer_kind('linear') is not CONV2D


def test_from_plain_and_set_filter_share_parameters():
    conv = nn.Conv2d(3, 4, 3, padding=1)
    gf = CONV2D.set_filter(conv, 4, True)
    assert isinstance(gf, GFConv2d) and gf.radius == 4 and gf.enabled
    assert gf.weight is conv.weight and gf.bias is conv.bias
    again = CONV2D.set_filter(gf, 2, False)
    assert again is gf and (gf.radius, gf.enabled) == (2, False)
    with pytest.raises(TypeError, match='cannot gradient-filter'):
        CONV2D.from_plain(_ConvWS(3, 4, 3), 4, True)


def test_geometry_of_a_call_is_the_cost_models():
    conv = nn.Conv2d(8, 16, 3, stride=2, padding=2, dilation=2, groups=2)
    x = torch.randn(2, 8, 20, 18)
    y = conv(x)
    geometry = CONV2D.geometry(conv, (x, ), y)
    assert geometry == ConvGeometry.of(conv, (8, 20, 18), y.shape[1:])
    assert geometry.describe() == '3/2/2/2'
    assert geometry.cost(4, batch=2) == ConvGeometry(
        (8, 20, 18), tuple(y.shape[1:]), (3, 3), (2, 2), (2, 2),
        2).cost(4, batch=2)


def test_a_clashing_kind_is_refused():
    clash = LayerKind(name='conv2d', noun='conv', traced_type=nn.Conv3d,
                      plain_types=(nn.Conv3d, ), filtered_type=nn.Conv3d,
                      from_plain=None, geometry=None, quality=None,
                      allowed='')
    with pytest.raises(ValueError, match="clashes with the registered kind "
                       "'conv2d'"):
        register_layer_kind(clash)
    same_type = LayerKind(name='conv2d_again', noun='conv',
                          traced_type=nn.Conv2d, plain_types=(nn.Conv2d, ),
                          filtered_type=GFConv2d, from_plain=None,
                          geometry=None, quality=None, allowed='')
    with pytest.raises(ValueError, match='clashes'):
        register_layer_kind(same_type)
    assert 'conv2d_again' not in [k.name for k in layer_kinds()]


def test_patch_grid_names_stay_importable_from_the_operator():
    from mmseg_gf.ops.conv import function as gradient_filter
    from mmseg_gf.ops import patch_grid
    for name in ('AxisGeometry', 'as_pair', 'check_radius', 'conv_geometry',
                 'resolve_padding', 'filter_output_grad',
                 'pool_input_patches', 'spread_to_input'):
        assert getattr(gradient_filter, name) is getattr(patch_grid, name)


def test_patch_partitioned_kinds_are_the_patch_mean_rules_layers():
    """The patch-mean GELU's producers and consumers are the filtered
    modules of the kinds that say their ``g_x`` is patch-constant (conv,
    Linear), read from the registry: the attention's output mixes tokens
    across patches, so it is neither."""
    pytest.importorskip('mmseg')
    from mmseg_gf.models import GFLinear, layer_kinds
    from mmseg_gf.models.gf_attention import GFMultiheadAttention
    from mmseg_gf.models.patch_mean_graph import is_filtered_layer
    flags = {kind.name: kind.patch_partitioned for kind in layer_kinds()}
    assert flags == {'conv2d': True, 'linear': True, 'attention': False}
    conv = CONV2D.from_plain(nn.Conv2d(2, 2, 1), 2, True)
    linear = GFLinear(2, 2, radius=2)
    attention = GFMultiheadAttention.from_attention(
        nn.MultiheadAttention(4, 2), 2, None)
    assert is_filtered_layer(conv) and is_filtered_layer(linear)
    assert not is_filtered_layer(attention)
    assert not is_filtered_layer(nn.Conv2d(2, 2, 1))


def test_the_conv_kinds_family_and_kernels():
    """The conv kind's family holds the convs no kind traces; the kernels
    are those of every traced conv (a weight-standardised one too), not a
    Linear's or a transposed conv's."""
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Linear(2, 2),
                          _ConvWS(2, 2, 1), nn.ConvTranspose2d(2, 2, 2),
                          GFConv2d(2, 2, 3))
    assert family_kind_of(model[3]) is CONV2D and traced_kind_of(
        model[3]) is None
    assert family_kind_of(model[1]) is layer_kind('linear')
    assert family_kind_of(nn.ReLU()) is None
    assert [(path, w is model.get_submodule(path).weight)
            for path, w in layer_kernels(model)] == [
                ('0', True), ('2', True), ('4', True)]
