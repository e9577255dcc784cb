"""Lean Hardsigmoid / mmcv HSigmoid / frozen PReLU and max-pool against the
plain modules (autograd's own formulas): the same forward and gradients bit
for bit, and only the bits (or uint8 window offsets) kept for backward."""
import copy
import itertools

import pytest
import torch
from torch import nn

from mmseg_gf.accounting.measured import saved_tensor_bytes
from mmseg_gf.models.lean import is_lean, lean_kind, make_lean, make_plain
from mmseg_gf.ops.bit_mask import masks as bit_mask


def _values(shape, seed=0, scale=4.0):
    """Random values with the kinks (+-3, 0), +-inf and NaN mixed in."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * scale
    flat = x.view(-1)
    specials = torch.tensor([0.0, -0.0, 3.0, -3.0, 1.0, -1.0, float('inf'),
                             -float('inf'), float('nan')])
    idx = torch.randperm(flat.numel(), generator=gen)[:specials.numel()]
    flat[idx] = specials[:idx.numel()]
    return x


def _lean_copy(module):
    module = copy.deepcopy(module)
    make_lean(module)
    assert is_lean(module)
    return module


def _forward_backward(module, x0, g):
    """Output and input gradient of ``module`` on ``x0`` taken as a
    non-leaf (as inside a network)."""
    x = x0.clone().requires_grad_(True)
    y = module(x * 1.0)
    y.backward(g)
    return y.detach(), x.grad


def _assert_same(plain, lean, x0):
    g = torch.randn(plain(x0).shape, generator=torch.Generator(
    ).manual_seed(9))
    (y0, g0), (y1, g1) = (_forward_backward(m, x0, g) for m in (plain, lean))
    assert torch.equal(y0.isnan(), y1.isnan())
    assert torch.equal(y0.nan_to_num(), y1.nan_to_num()), 'forward differs'
    assert torch.equal(g0.isnan(), g1.isnan())
    assert torch.equal(g0.nan_to_num(), g1.nan_to_num()), 'gradient differs'


def _kept(module, x0):
    x = x0.clone().requires_grad_(True)
    return saved_tensor_bytes(lambda: module(x * 1.0))


def _frozen_prelu(channels, seed=0):
    prelu = nn.PReLU(channels)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        prelu.weight.copy_(torch.randn(channels, generator=gen))
    return prelu.requires_grad_(False)


def _mmcv_hsigmoid(**kwargs):
    mmcv_bricks = pytest.importorskip('mmcv.cnn.bricks.hsigmoid')
    with pytest.warns(UserWarning):
        return mmcv_bricks.HSigmoid(**kwargs)


ACTIVATIONS = {
    'hardsigmoid': lambda: nn.Hardsigmoid(),
    'hardsigmoid_inplace': lambda: nn.Hardsigmoid(inplace=True),
    'prelu_1': lambda: _frozen_prelu(1),
    'prelu_per_channel': lambda: _frozen_prelu(5),
    'mmcv_hsigmoid': lambda: _mmcv_hsigmoid(),
    'mmcv_hsigmoid_mmseg_se': lambda: _mmcv_hsigmoid(bias=3.0, divisor=6.0),
    'mmcv_hsigmoid_other': lambda: _mmcv_hsigmoid(
        bias=1.0, divisor=2.0, min_value=-0.5, max_value=0.75),
}


@pytest.mark.parametrize('native', [True, False])
@pytest.mark.parametrize('name', sorted(ACTIVATIONS))
def test_piecewise_activation_same_forward_grad_and_keeps_bits(
        name, native, switch_override):
    if not native:
        switch_override(MMSEG_GF_NATIVE=False)
    plain = ACTIVATIONS[name]()
    lean = _lean_copy(plain)
    assert lean_kind(lean) == 'activation' and isinstance(lean, type(plain))
    x0 = _values((2, 5, 7, 9), seed=len(name))
    _assert_same(plain, lean, x0)
    # exactly on the bounds of mmcv's clamp: (x + 1) / 2 == -0.5 and 0.75
    if name == 'mmcv_hsigmoid_other':
        _assert_same(plain, lean, torch.tensor([-2.0, 0.5, 0.4, -1.9]))
    finite = x0.nan_to_num(0.0, 5.0, -5.0)
    assert _kept(lean, finite) == bit_mask.packed_bytes(x0.numel())
    assert _kept(plain, finite) >= x0.numel() * 4


def test_trained_prelu_stays_plain():
    prelu = _frozen_prelu(5).requires_grad_(True)
    lean = _lean_copy(prelu)
    x0 = _values((2, 5, 4, 4))
    assert _kept(lean, x0) == _kept(prelu, x0) >= x0.numel() * 4
    x = x0.clone().requires_grad_(True)
    lean(x * 1.0).sum().backward()
    assert lean.weight.grad is not None
    assert make_plain(lean) and type(lean) is nn.PReLU


POOLS = [
    dict(kernel_size=3, stride=2, padding=1),  # the ResNet stem
    dict(kernel_size=2, stride=2),  # ERFNet's downsampler
    dict(kernel_size=3, stride=2, padding=1, ceil_mode=True),
    dict(kernel_size=(3, 2), stride=(1, 2), padding=(1, 0)),
    dict(kernel_size=3, stride=1, padding=1, dilation=2),
    dict(kernel_size=(2, 3), stride=(3, 1), dilation=(2, 1), ceil_mode=True),
    dict(kernel_size=16, stride=4, padding=8),  # a 256-element window
]


@pytest.mark.parametrize('size', [(9, 9), (8, 11), (13, 6)])
@pytest.mark.parametrize('case', range(len(POOLS)))
def test_max_pool_same_forward_grad_and_keeps_offsets(case, size):
    kwargs = POOLS[case]
    if kwargs['kernel_size'] == 16 and min(size) < 16:
        size = (17, 19)
    plain = nn.MaxPool2d(**kwargs)
    lean = _lean_copy(plain)
    assert lean_kind(lean) == 'pool'
    gen = torch.Generator().manual_seed(case)
    inputs = {
        'random': torch.randn(2, 3, *size, generator=gen),
        # ties everywhere: torch's choice among equal elements must be kept
        'constant': torch.ones(2, 3, *size),
        'few_values': torch.randint(0, 3, (2, 3, *size), generator=gen
                                    ).float(),
        'specials': _values((2, 3, *size), seed=case),
    }
    for x0 in inputs.values():
        _assert_same(plain, lean, x0)
    out = plain(inputs['random'])
    assert _kept(lean, inputs['random']) == out.numel()
    assert _kept(plain, inputs['random']) == out.numel() * 8 + \
        inputs['random'].numel() * 4


def test_max_pool_outside_the_lean_path_is_plain():
    x0 = torch.randn(2, 3, 20, 20)
    for plain, x in [(nn.MaxPool2d(17, 1), x0),  # window > 256
                     (nn.MaxPool2d(2, return_indices=True), x0),
                     (nn.MaxPool2d(2), x0[0]),  # unbatched
                     (nn.MaxPool2d(2), x0.transpose(2, 3))]:  # strided
        lean = _lean_copy(plain)
        assert not lean.keeps_offsets(x)
        xs = [x.detach().clone().requires_grad_(True) for _ in range(2)]
        outs = [m(t) for m, t in zip((plain, lean), xs)]
        if isinstance(outs[0], tuple):
            assert all(torch.equal(a, b) for a, b in zip(*outs))
            continue
        assert torch.equal(*outs)
        for o in outs:
            o.sum().backward()
        assert torch.equal(xs[0].grad, xs[1].grad)


@pytest.mark.parametrize('kernel, stride, padding, dilation, ceil_mode',
                         list(itertools.product([1, 2, 3], [1, 2, 3], [0, 1],
                                                [1, 2], [False, True])))
def test_max_pool_grid(kernel, stride, padding, dilation, ceil_mode):
    """Every small geometry torch accepts, on an odd size with ties."""
    if padding > kernel // 2:
        pytest.skip('torch refuses padding > kernel / 2')
    plain = nn.MaxPool2d(kernel, stride, padding, dilation,
                         ceil_mode=ceil_mode)
    lean = _lean_copy(plain)
    gen = torch.Generator().manual_seed(kernel * 100 + stride)
    x0 = torch.randint(0, 4, (1, 2, 7, 9), generator=gen).float()
    _assert_same(plain, lean, x0)


@pytest.mark.parametrize('kwargs', [
    dict(kernel_size=3, stride=2, padding=1),  # STDC, CGNet downsamplers
    dict(kernel_size=49, stride=(16, 20)),  # LRASPP's image pool
    dict(kernel_size=3, stride=2, padding=1, ceil_mode=True,
         count_include_pad=False),
    dict(kernel_size=(2, 3), divisor_override=5),
])
def test_avg_pool_same_forward_grad_and_keeps_shape_only(kwargs):
    plain = nn.AvgPool2d(**kwargs)
    lean = _lean_copy(plain)
    assert lean_kind(lean) == 'pool'
    size = (64, 70) if kwargs['kernel_size'] == 49 else (9, 11)
    x0 = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(4))
    _assert_same(plain, lean, x0)
    # a channels-last input: the backward follows its memory format
    _assert_same(plain, lean, x0.contiguous(memory_format=torch.channels_last))
    assert _kept(lean, x0) == 0
    assert _kept(plain, x0) == x0.numel() * 4
