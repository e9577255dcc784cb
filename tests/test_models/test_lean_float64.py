"""Every lean module kind in float64 against its plain module (autograd).

float64 is how the suite and users check exactness, so each lean variant
(:mod:`mmseg_gf.models.lean`, :mod:`~mmseg_gf.models.lean_transformer`)
is run on float64 weights and inputs next to the same module with its
plain class: the forward and the input gradient must be equal bit for bit
(``torch.equal``, NaN positions included) wherever the lean backward runs
autograd's own operations in autograd's order. Where the math is not the
same the tolerance is stated with its reason in :data:`TOLERANCES`.

:func:`test_every_lean_kind_has_a_float64_case` keeps the list complete:
a kind added to ``LEAN_KINDS`` without a case here (or a reason in
:data:`ELSEWHERE`) fails it.
"""
import copy

import pytest
import torch
from torch import nn

from mmseg_gf.accounting.measured import saved_tensor_bytes
from mmseg_gf.models.lean import LEAN_KINDS, is_lean, lean_kind, make_lean
from tests.helpers.devices import needs_token_kinds

F64 = torch.float64

#: Cases whose lean backward computes in another order than autograd's,
#: with the relative tolerance of their float64 gradient and why.
TOLERANCES = {
    # the per-token mean of the kept input is recomputed by
    # ``Tensor.mean`` (autograd's kernel keeps its own running moments):
    # the two sums round differently in the last bit
    'layer_norm': 1e-14,
    # SDPA (the flash kernel: blocked online softmax) against the
    # explicit softmax(q k^T) v of the plain module
    'attention_torch': 1e-12,
    'attention_mmcv': 1e-12,
    'attention_swin': 1e-12,
    'attention_twins': 1e-12,
}

#: Lean kinds compared elsewhere, where the comparison needs a whole
#: model or a device; each with the test that does it in float64.
ELSEWHERE = {
    # decode heads: the loss's gradient is taken in the forward
    # (resized_loss, fused_classifier): float64 against autograd in
    # tests/test_ops/resized_loss/test_resized_loss.py and test_fused_loss_ops.py
    'loss': 'tests/test_ops/resized_loss/test_resized_loss.py',
    # installed by the engine on a traced step only; float64 against the
    # exact GELU in tests/test_ops/linear/test_patch_mean_activation.py
    'patch_mean_gelu': 'tests/test_ops/linear/test_patch_mean_activation.py',
}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(shape, seed=0, scale=1.0):
    return torch.randn(shape, generator=_gen(seed), dtype=F64) * scale


def _with_specials(shape, seed=0):
    """Random values with kinks (0, +-1, +-3, +-6) and non-finite ones."""
    x = _randn(shape, seed, 4.0)
    flat = x.view(-1)
    specials = torch.tensor([0.0, -0.0, 3.0, -3.0, 1.0, -1.0, 6.0,
                             float('inf'), -float('inf'), float('nan')],
                            dtype=F64)
    idx = torch.randperm(flat.numel(), generator=_gen(seed + 1))
    flat[idx[:specials.numel()]] = specials
    return x


def _frozen(module):
    return module.to(F64).requires_grad_(False)


def _frozen_bn(channels, affine=True):
    bn = nn.BatchNorm2d(channels, affine=affine)
    bn.running_mean.copy_(torch.randn(channels, generator=_gen(2)))
    bn.running_var.copy_(torch.rand(channels, generator=_gen(3)) + 0.1)
    if affine:
        with torch.no_grad():
            bn.weight.copy_(torch.randn(channels, generator=_gen(4)))
            bn.bias.copy_(torch.randn(channels, generator=_gen(5)))
    return _frozen(bn).eval()


def _seeded(module):
    torch.manual_seed(0)
    return module()


def _mmcv(path, name, **kwargs):
    return getattr(pytest.importorskip(path), name)(**kwargs)


def _randomised(module):
    """Frozen, with every parameter drawn (relative position bias tables
    are zeros after init)."""
    with torch.no_grad():
        for i, p in enumerate(module.parameters()):
            p.copy_(0.3 * torch.randn(p.shape, generator=_gen(10 + i)))
    return _frozen(module)


def _image(shape=(2, 5, 7, 9), specials=False, nan=True):
    """``shape`` random values; with ``specials`` kinks and non-finite
    values mixed in (no NaN with ``nan=False``)."""
    x = _with_specials(shape) if specials else _randn(shape)
    return x if nan else x.nan_to_num(nan=0.5)


#: name -> (plain module factory, inputs factory, call); the input
#: gradients of all inputs are compared. ``call(module, *inputs)``.
CASES = {
    'norm': (lambda: _frozen_bn(5), lambda: [_image()], None),
    'norm_no_affine': (lambda: _frozen_bn(5, affine=False),
                       lambda: [_image()], None),
    'norm_channels_last': (
        lambda: _frozen_bn(5),
        lambda: [_image().contiguous(memory_format=torch.channels_last)],
        None),
    'relu': (lambda: nn.ReLU(), lambda: [_image(specials=True)], None),
    'relu_inplace': (lambda: nn.ReLU(inplace=True),
                     lambda: [_image(specials=True)], None),
    # No NaN into Hardtanh: torch's own backward is not consistent there
    # (its vectorised loop drops the gradient at a NaN input, its scalar
    # tail passes it, so the result depends on the element's position and
    # the CPU's vector width); the lean mask passes it
    'relu6': (lambda: nn.ReLU6(), lambda: [_image(specials=True, nan=False)],
              None),
    'hardtanh': (lambda: nn.Hardtanh(-2.0, 3.0),
                 lambda: [_image(specials=True, nan=False)], None),
    'leaky_relu': (lambda: nn.LeakyReLU(0.1),
                   lambda: [_image(specials=True)], None),
    'hardsigmoid': (lambda: nn.Hardsigmoid(),
                    lambda: [_image(specials=True)], None),
    'prelu': (lambda: _randomised(nn.PReLU(5)),
              lambda: [_image(specials=True)], None),
    'mmcv_hsigmoid': (
        lambda: _mmcv('mmcv.cnn.bricks.hsigmoid', 'HSigmoid', bias=3.0,
                      divisor=6.0),
        lambda: [_image(specials=True)], None),
    'dropout': (lambda: nn.Dropout(0.3), lambda: [_image()], None),
    'mmcv_dropout': (lambda: _mmcv('mmcv.cnn.bricks.drop', 'Dropout',
                                   drop_prob=0.3),
                     lambda: [_image()], None),
    'adaptive_avg_pool': (lambda: nn.AdaptiveAvgPool2d((3, 2)),
                          lambda: [_image()], None),
    'max_pool': (lambda: nn.MaxPool2d(3, 2, 1), lambda: [_image()], None),
    'avg_pool': (lambda: nn.AvgPool2d(3, 2, 1, ceil_mode=True),
                 lambda: [_image()], None),
    'frozen_conv': (lambda: _frozen(_seeded(lambda: nn.Conv2d(
        5, 4, 3, stride=2, padding=1))), lambda: [_image()], None),
    'frozen_conv_grouped': (lambda: _frozen(_seeded(lambda: nn.Conv2d(
        5, 10, 3, padding=2, dilation=2, groups=5))),
        lambda: [_image()], None),
    'frozen_linear': (lambda: _frozen(_seeded(lambda: nn.Linear(9, 6))),
                      lambda: [_image()], None),
    'layer_norm': (lambda: _randomised(nn.LayerNorm(9)),
                   lambda: [_image()], None),
    'drop_path': (lambda: _mmcv('mmcv.cnn.bricks.drop', 'DropPath',
                                drop_prob=0.4),
                  lambda: [_randn((6, 5, 4))], None),
    'attention_torch': (
        lambda: _randomised(nn.MultiheadAttention(8, 2, batch_first=True)),
        lambda: [_randn((2, 10, 8)), _randn((2, 6, 8), 1)],
        lambda m, q, kv: m(q, kv, kv, need_weights=False)[0]),
    'attention_mmcv': (
        lambda: _randomised(_mmcv('mmcv.cnn.bricks.transformer',
                                  'MultiheadAttention', embed_dims=8,
                                  num_heads=2, batch_first=True)),
        lambda: [_randn((2, 10, 8))], None),
    'attention_swin': (
        lambda: _randomised(_mmcv('mmseg.models.backbones.swin',
                                  'WindowMSA', embed_dims=8, num_heads=2,
                                  window_size=(3, 3))),
        lambda: [_randn((4, 9, 8))], None),
    'attention_twins': (
        lambda: _randomised(_mmcv('mmseg.models.backbones.twins',
                                  'LocallyGroupedSelfAttention',
                                  embed_dims=8, num_heads=2, window_size=3)),
        lambda: [_randn((2, 30, 8))], lambda m, x: m(x, (5, 6))),
    'conv_block': (
        lambda: _randomised(_mmcv(
            'mmcv.cnn', 'ConvModule', in_channels=5, out_channels=4,
            kernel_size=3, padding=1, norm_cfg=dict(type='BN'))).eval(),
        lambda: [_image()], None),
}

#: The lean kind each case covers.
KIND_OF_CASE = {name: name for name in CASES}
KIND_OF_CASE.update({
    'norm_no_affine': 'norm', 'norm_channels_last': 'norm',
    'relu': 'activation', 'relu_inplace': 'activation',
    'relu6': 'activation', 'hardtanh': 'activation',
    'leaky_relu': 'activation', 'hardsigmoid': 'activation',
    'prelu': 'activation', 'mmcv_hsigmoid': 'activation',
    'mmcv_dropout': 'dropout', 'adaptive_avg_pool': 'pool',
    'max_pool': 'pool', 'avg_pool': 'pool',
    'frozen_conv_grouped': 'frozen_conv', 'attention_torch': 'attention',
    'attention_mmcv': 'attention', 'attention_swin': 'attention',
    'attention_twins': 'attention'})


def _lean_copy(module):
    lean = copy.deepcopy(module)
    for m in lean.modules():
        make_lean(m)
    return lean


def _run(module, inputs, call, seed=11):
    """Output and the gradients of a fixed random projection w.r.t.
    ``inputs`` (each fed as a non-leaf, as inside a network)."""
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    torch.manual_seed(seed)  # dropout's, DropPath's draws
    args = [t * 1.0 for t in leaves]
    out = call(module, *args) if call else module(*args)
    g = torch.randn(out.shape, generator=_gen(seed), dtype=out.dtype)
    grads = torch.autograd.grad(out, leaves, g)
    return out.detach(), grads


def _equal(a, b):
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(
        a.nan_to_num(), b.nan_to_num())


#: Cases of the Linear and attention kinds, registered with mmseg.
TOKEN_KIND_CASES = ('frozen_linear', 'attention_torch')


@pytest.mark.parametrize('name', [
    pytest.param(n, marks=needs_token_kinds) if n in TOKEN_KIND_CASES else n
    for n in sorted(CASES)])
def test_lean_kind_in_float64_equals_autograd(name):
    make, inputs, call = CASES[name]
    plain = make()
    lean = _lean_copy(plain)
    assert any(is_lean(m) and lean_kind(m) == KIND_OF_CASE[name]
               for m in lean.modules()), f'{name}: nothing lean'
    xs = inputs()
    assert all(t.dtype == F64 for t in xs)
    (y0, g0), (y1, g1) = _run(plain, xs, call), _run(lean, xs, call)
    assert y1.dtype == F64 and all(g.dtype == F64 for g in g1)
    rtol = TOLERANCES.get(name)
    if rtol is None:
        assert _equal(y1, y0), f'{name}: forward differs'
        for a, b in zip(g1, g0):
            assert _equal(a, b), (
                f'{name}: gradient differs by '
                f'{(a - b).nan_to_num().abs().max().item():.3g}')
        return
    torch.testing.assert_close(y1, y0, rtol=rtol, atol=rtol)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=rtol,
                                   atol=rtol * float(b.abs().max()))


def test_every_lean_kind_has_a_float64_case():
    covered = set(KIND_OF_CASE.values()) | set(ELSEWHERE)
    assert set(LEAN_KINDS) <= covered, set(LEAN_KINDS) - covered


def test_float32_norm_keeps_its_one_factor():
    """float32 keeps one float32 factor (``C`` scales kept, one product:
    within float32 rounding of autograd's gradient); float64 keeps ``C``
    float64 scales (the weight, a Parameter, is referenced)."""
    plain = _frozen_bn(5).float()
    lean = _lean_copy(plain)
    x = _image().float()
    assert saved_tensor_bytes(
        lambda: lean(x.clone().requires_grad_(True) * 1.0)) == 5 * 4
    (_, (g0, )), (_, (g1, )) = (_run(m, [x], None) for m in (plain, lean))
    torch.testing.assert_close(g1, g0, rtol=1e-6, atol=0)
    lean64 = _lean_copy(_frozen_bn(5))
    xd = _image().requires_grad_(True)
    assert saved_tensor_bytes(lambda: lean64(xd * 1.0)) == 5 * 8
