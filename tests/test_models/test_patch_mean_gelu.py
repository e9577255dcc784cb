"""The patch-mean GELU module and the partitions filtered layers report
(docs/gradient_filter.md#elementwise-ops-between-filtered-layers).

* a filtered layer marks its output with its output patches, and says on
  which input patches its ``g_x`` is constant (None where those are not
  the map's ``r x r`` tiles from 0: stride 2, no padding, reflect padding);
* a patch-mean GELU runs the rule only on an unchanged, marked input on its
  own partition, else autograd's GELU; ``make_plain`` swaps it back; on
  CUDA tensors too (``pytest -m cuda``), its input gradient the patch rule's.
"""
import pytest
import torch
from torch import nn

from mmseg_gf.models.gf_conv import GFConv2d
from mmseg_gf.models.gf_linear import GFLinear, TokenGridSource
from mmseg_gf.models.lean import is_lean, lean_kind, make_plain
from mmseg_gf.models.patch_mean_gelu import (is_patch_mean_gelu,
                                             make_patch_mean_gelu)
from mmseg_gf.ops import TokenGrid
from mmseg_gf.ops.linear.patch_mean_activation import (PatchPartition,
                                                       tagged_partition)
from tests.helpers.devices import DEVICES


def _linear(radius, grid, device='cpu'):
    return GFLinear.from_linear(nn.Linear(4, 6), radius,
                                TokenGridSource(grid)).to(device)


def test_filtered_layers_mark_their_output_and_report_input_patches():
    x = torch.randn(2, 3, 9, 7, requires_grad=True)
    conv = GFConv2d(3, 3, 3, padding=1, radius=4)
    assert tagged_partition(conv(x)) == PatchPartition.conv_map(4, 9, 7)
    assert conv.input_partition(x) == PatchPartition.conv_map(4, 9, 7)
    assert GFConv2d(3, 3, 1, radius=4).input_partition(x) == \
        PatchPartition.conv_map(4, 9, 7)
    for other in (GFConv2d(3, 3, 3, radius=4),  # c = 1
                  GFConv2d(3, 3, 1, stride=2, radius=4),  # in_patch = 2r
                  GFConv2d(3, 3, 3, padding=1, padding_mode='reflect',
                           radius=4)):
        assert other.input_partition(x) is None, other
    with torch.no_grad():  # not filtered: no mark
        assert tagged_partition(conv(x)) is None
    grid = TokenGrid(3, 4, extra_tokens=1)
    tokens = torch.randn(2, 13, 4, requires_grad=True)
    linear = _linear(2, grid)
    want = PatchPartition.tokens(grid, 2, 1)
    assert tagged_partition(linear(tokens)) == want
    assert linear.input_partition(tokens) == want
    assert _linear(2, None).input_partition(tokens) is None


@pytest.mark.parametrize('device', DEVICES)
def test_the_rule_runs_only_on_its_partitions_unchanged_output(device):
    grid = TokenGrid(4, 4)
    x = torch.randn(2, 16, 4, device=device, requires_grad=True)
    up = _linear(2, grid, device)
    gelu = nn.GELU()
    make_patch_mean_gelu(gelu, PatchPartition.tokens(grid, 2, 1))
    assert is_patch_mean_gelu(gelu) and isinstance(gelu, nn.GELU)
    assert is_lean(gelu) and lean_kind(gelu) == 'patch_mean_gelu'

    def node(t):
        return type(gelu(t).grad_fn).__name__

    assert node(up(x)) == 'PatchMeanGeluFunctionBackward'
    assert gelu._gf_patch_mean_call == (2, 16, 6)
    assert node(up(x) + 0) == 'GeluBackward0'  # not the layer's output
    assert gelu._gf_patch_mean_call is None
    assert node(_linear(4, grid, device)(x)) == 'GeluBackward0'  # another r
    # the rule's input gradient: g_y times the patch means of GELU'
    u = up(x)
    g = torch.randn(u.shape, device=device)
    got, = torch.autograd.grad(gelu(u), u, g)
    slope = torch.ops.aten.gelu_backward(torch.ones_like(u), u.detach())
    means = slope.view(2, 2, 2, 2, 2, 6).mean(dim=(2, 4), keepdim=True)
    want = g * means.expand(2, 2, 2, 2, 2, 6).reshape(u.shape)
    assert got.device == u.device
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    conv = GFConv2d(3, 3, 1, radius=2).to(device)
    gelu_map = nn.GELU(approximate='tanh')
    make_patch_mean_gelu(gelu_map, PatchPartition.conv_map(2, 4, 4))
    maps = torch.randn(1, 3, 4, 4, device=device, requires_grad=True)
    assert type(gelu_map(conv(maps)).grad_fn).__name__ == \
        'PatchMeanGeluFunctionBackward'
    changed = conv(maps)
    changed.mul_(2)  # changed in place after the layer
    assert type(gelu_map(changed).grad_fn).__name__ == 'GeluBackward0'
    with torch.no_grad():
        assert gelu(up(x)).grad_fn is None
    assert make_plain(gelu) and type(gelu) is nn.GELU
    with pytest.raises(TypeError, match='not an nn.GELU'):
        make_patch_mean_gelu(nn.ReLU(), PatchPartition.tokens(grid, 2, 1))
