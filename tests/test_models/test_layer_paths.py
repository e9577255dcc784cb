"""layer_path: the implementation a filtered or lean layer runs, as the
dispatcher explains it, and what the layer table prints."""
import torch
from torch import nn

from mmseg_gf.models import GFConv2d, GFLinear
from mmseg_gf.models.layer_paths import layer_path, representative_input
from mmseg_gf.ops.backend import availability, dispatch, extension, switches


def _conv():
    torch.manual_seed(0)
    return GFConv2d(3, 4, 3, padding=1, radius=2)


def test_a_filtered_conv_takes_the_kernel_or_says_why_not():
    conv = _conv()
    x = representative_input(conv, (3, 8, 8))
    assert x.shape == (1, 3, 8, 8) and x.requires_grad
    with switches.override(MMSEG_GF_NATIVE=True):
        on = layer_path(conv, x)
    assert on == ('c++' if availability.native_available() else
                  'torch: cpu tensor (triton), mmseg_gf._patch_ops not '
                  'built (c++)')
    with switches.override(MMSEG_GF_NATIVE=False):
        off = layer_path(conv, x)
    reason = 'MMSEG_GF_NATIVE off' if extension.built() else \
        'mmseg_gf._patch_ops not built'
    assert off == f'torch: cpu tensor (triton), {reason} (c++)'


def test_the_path_is_the_one_the_layer_runs():
    """A float64 call: the conv's own call is explained with the same
    label (the choice cached for its signature)."""
    conv = _conv().double()
    x = torch.randn(1, 3, 8, 8, dtype=torch.float64, requires_grad=True)
    label = layer_path(conv, x)
    conv(x).sum().backward()
    assert dispatch.explain('conv', x, conv.weight, conv.bias, (1, 1),
                            (1, 1), (1, 1), 1, 2).label() == label


def test_exact_layers_and_uncovered_modules():
    conv = _conv()
    conv.enabled = False
    assert layer_path(conv, representative_input(conv, (3, 8, 8))) == 'exact'
    plain = nn.Conv2d(3, 4, 3)
    assert layer_path(plain, torch.zeros(1, 3, 8, 8)) is None


def test_a_filtered_linear_names_its_backward():
    linear = GFLinear(6, 5, radius=2)
    x = representative_input(linear, (4, 6))
    with switches.override(MMSEG_GF_NATIVE=False):
        assert layer_path(linear, x).endswith('MMSEG_GF_NATIVE off (c++)') \
            or not extension.built()
    frozen = GFLinear(6, 5, radius=2).requires_grad_(False)
    assert layer_path(frozen, torch.zeros(1, 4, 6)) == 'exact'


def test_lean_layers_name_their_operator():
    from mmseg_gf.models.lean import make_lean
    act = nn.ReLU()
    norm = nn.BatchNorm2d(2).eval().requires_grad_(False)
    assert make_lean(act) and make_lean(norm)
    x = torch.zeros(1, 2, 4, 4)
    with switches.override(MMSEG_GF_NATIVE=False):
        assert layer_path(act, x) == \
            'torch: cpu tensor (triton), MMSEG_GF_NATIVE off (c++)' or \
            not extension.built('bit_mask')
    assert layer_path(act, x) == dispatch.explain('bit_mask', x).label()
    assert layer_path(norm, x) == 'torch: cpu tensor (triton)'
    channels_last = x.contiguous(memory_format=torch.channels_last)
    assert layer_path(act, channels_last) == dispatch.explain(
        'bit_mask', channels_last.permute(0, 2, 3, 1)).label()
