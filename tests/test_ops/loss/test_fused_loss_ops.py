"""The loss-gradient functions (:mod:`mmseg_gf.ops.loss.gradients`,
:mod:`mmseg_gf.ops.loss.fused_classifier`) against
autograd on plain convolutions and losses: outputs with different incoming
gradients, accumulation into ``.grad``, strided / padded / dilated /
grouped convolutions whose input does not fit their stride."""
import copy

import pytest
import torch

from mmseg_gf.ops.loss.fused_classifier import (ConvSpec,
                                                FusedClassifierLossFunction,
                                                channel_scaled_classifier,
                                                input_gradient,
                                                weight_and_bias_gradients)
from mmseg_gf.ops.loss.gradients import (LogitGradients,
                                         PrecomputedGradientLossFunction,
                                         loss_gradients)
from tests.helpers.devices import DEVICES


def _losses(*logits):
    """Two scalar losses and a non-differentiable metric of the logits."""
    z = logits[0]
    out = {'loss_a': (z.sin() * z).mean(), 'metric': z.detach().max()}
    out['loss_b'] = sum((t ** 2).sum() * 0.01 for t in logits)
    return out


def _generic(z):
    values, grads = loss_gradients(_losses, [z])
    mix = {k: [(i, 1.0)] for i, k in enumerate(grads)}
    return LogitGradients(values, [g[0] for g in grads.values()], mix)


CONVS = [
    # (C, K, kernel, stride, padding, dilation, groups, input size)
    (6, 4, 1, 1, 0, 1, 1, (7, 5)),  # a classifier: the matrix-product path
    (16, 5, 1, 1, 0, 1, 1, (9, 11)),
    (6, 4, 1, 2, 0, 1, 1, (7, 5)),  # 1x1, strided: the convolution path
    (6, 4, 3, 2, 1, 1, 1, (8, 7)),
    (6, 4, 3, 1, 2, 2, 2, (6, 6)),
    (4, 4, 3, 2, 0, 1, 4, (9, 8)),
]


#: How far apart two orders of the same float sums may fall, in units of
#: ``eps * sum|terms|`` (see :func:`_assert_within_rounding`).
ROUNDING_FACTOR = 16


def _seeded_conv(seed, *args, **kwargs):
    """A ``Conv2d`` with torch's default initialisation, drawn from its own
    seed: under pytest-xdist the global generator's state depends on the
    files that ran earlier in the worker, and so would the weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.Conv2d(*args, **kwargs)


def _gradient_magnitudes(layer, x0, spec, weights):
    """``sum|terms|`` of each element of ``g_x``, ``g_W``, ``g_b`` (the
    parameters' in ``layer.parameters()`` order): the same gradients with
    ``x``, ``W`` and every loss's own ``g_z`` replaced by their absolute
    values, in float64. ``weights``: loss key -> its total factor in the
    backwards summed. The loss terms count one by one: they are added in
    the backward (fused) or in the graph (autograd), and where they cancel
    in ``g_z`` their rounding does not."""
    layer = copy.deepcopy(layer).double()
    x = x0.detach().double()
    z = layer(x)
    out = _losses(z)
    g_z = sum(w * torch.autograd.grad(out[k], z, retain_graph=True)[0].abs()
              for k, w in weights.items())
    w_abs = layer.weight.detach().abs()
    conv = (spec.stride, spec.padding, spec.dilation, spec.groups)
    g_x = torch.nn.grad.conv2d_input(x.shape, w_abs, g_z, *conv)
    g_w = torch.nn.grad.conv2d_weight(x.abs(), w_abs.shape, g_z, *conv)
    return g_x, [g_w, g_z.sum((0, 2, 3))][:len(list(layer.parameters()))]


def _assert_within_rounding(got, want, magnitude, what):
    """``got`` and ``want`` are the same sums of products added in other
    orders (the fused path's matrix products against autograd's convolution
    backward). A sum of ``n`` terms in a blocked or pairwise order, as BLAS
    and oneDNN add, is within about ``log2(n) * eps * sum|terms|`` of the
    exact one, so two such orders are within twice that: the factor 16
    covers the ``n <= 198`` terms here (measured over 200 weight draws of
    every case, 1 and 2 threads, either dtype: at most 4.5). An element-wise
    ``rtol`` / ``atol`` is no such bound: where the terms cancel, rounding
    is large against the result (with other weights, a ``g_W`` element of
    2.1e-3 came out 1.2e-7 apart, 5.9e-5 of itself)."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    bound = ROUNDING_FACTOR * torch.finfo(want.dtype).eps * magnitude
    excess = (got.double() - want.double()).abs() - bound
    worst = int(excess.argmax())
    assert excess.max() <= 0, (
        f'{what}: element {worst} (flat) is {got.flatten()[worst].item()!r}'
        f', autograd\'s {want.flatten()[worst].item()!r}; rounding allows '
        f'{bound.flatten()[worst].item():.3g}')


@pytest.mark.parametrize('dtype', ['float32', 'float64'])
@pytest.mark.parametrize('conv', CONVS)
@pytest.mark.parametrize('bias', [True, False])
@pytest.mark.parametrize('layout', ['nchw', 'channels_last'])
@pytest.mark.parametrize('device', DEVICES)
def test_fused_classifier_equals_autograd(conv, bias, layout, device, dtype):
    """The fused function's outputs and ``g_x``, ``g_W``, ``g_b`` against
    autograd's through the plain conv, two backwards accumulated: the
    gradients equal up to the rounding of their sums
    (:func:`_assert_within_rounding`; float64 makes that bound ~1e-16 of
    the terms, so any term missing or wrong shows)."""
    c, k, kernel, stride, padding, dilation, groups, size = conv
    fmt = torch.channels_last if layout == 'channels_last' else \
        torch.contiguous_format
    dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn((2, c) + size, generator=gen, dtype=dtype)
    layer = _seeded_conv(1, c, k, kernel, stride, padding, dilation, groups,
                         bias=bias).to(dtype=dtype)
    spec = ConvSpec.of(layer)
    scales = {'loss_a': 3.0, 'loss_b': 0.25}
    magnitudes = _gradient_magnitudes(
        layer, x0, spec, {key: s * (1 + 2) for key, s in scales.items()})
    x0 = x0.to(device).contiguous(memory_format=fmt)
    layer = layer.to(device, memory_format=fmt)
    results = []
    for fused in (False, True):
        layer.zero_grad(set_to_none=True)
        x = x0.clone(memory_format=fmt).requires_grad_(True)
        for step in range(2):  # accumulation into .grad
            if fused:
                keys = []
                with torch.no_grad():
                    z = layer(x)
                values = FusedClassifierLossFunction.apply(
                    x, layer.weight, layer.bias, z, None, spec, _generic,
                    keys)
                out = dict(zip(keys, values))
            else:
                out = _losses(layer(x))
            sum(out[k] * s * (step + 1) for k, s in scales.items()).backward()
        results.append((out, x.grad, [p.grad for p in layer.parameters()]))
    (want, want_x, want_p), (got, got_x, got_p) = results
    assert got_x.is_contiguous(memory_format=fmt)
    assert got_x.device.type == device
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=0)
    assert not got['metric'].requires_grad
    mag_x, mag_p = magnitudes
    _assert_within_rounding(got_x, want_x, mag_x.to(device), 'g_x')
    for name, g, w, m in zip(('g_W', 'g_b'), got_p, want_p, mag_p):
        _assert_within_rounding(g, w, m.to(device), name)


def test_precomputed_gradients_of_a_tuple_equal_autograd():
    gen = torch.Generator().manual_seed(1)
    logits0 = [torch.randn(2, 3, 4, 5, generator=gen),
               torch.randn(2, 1, 4, 5, generator=gen)]
    results = []
    for precomputed in (False, True):
        logits = [t.clone().requires_grad_(True) for t in logits0]
        for scale in (1.0, 1024.0):
            if precomputed:
                keys = []
                values = PrecomputedGradientLossFunction.apply(
                    _losses, keys, [], *logits)
                out = dict(zip(keys, values))
            else:
                out = _losses(*logits)
            (out['loss_a'] * scale + out['loss_b'] * 2.0).backward()
        results.append((out, [t.grad for t in logits]))
    (want, want_g), (got, got_g) = results
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=0)
    for g, w in zip(got_g, want_g):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


def test_loss_gradients_refuses_what_it_cannot_keep():
    z = torch.randn(2, 3)
    weight = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match='only scalar'):
        loss_gradients(lambda t: {'loss': t * 2}, [z])
    with pytest.raises(ValueError, match='trainable parameters'):
        loss_gradients(lambda t: {'loss': (t * weight).sum()}, [z],
                       [weight])


@pytest.mark.parametrize('layout', [torch.contiguous_format,
                                    torch.channels_last])
def test_pointwise_classifier_gradients_copy_nothing(layout):
    """A 1x1 classifier's g_x, g_W and g_b are matrix products that read
    x and write g_x in x's layout: equal to autograd's, no copy."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, 9, 11, generator=gen).contiguous(
        memory_format=layout)
    layer = torch.nn.Conv2d(16, 5, 1)
    g_z = torch.randn(2, 5, 9, 11, generator=gen)
    spec = ConvSpec.of(layer)
    with torch.profiler.profile() as prof:
        g_x = input_gradient(g_z, layer.weight.detach(), x.shape, spec,
                             layout)
        g_w, g_b = weight_and_bias_gradients(x, layer.weight.detach(), g_z,
                                             spec, True)
    copies = [e.name for e in prof.events()
              if e.name in ('aten::clone', 'aten::contiguous', 'aten::copy_')]
    assert not copies
    leaf = x.clone(memory_format=layout).requires_grad_(True)
    layer(leaf).backward(g_z)
    assert g_x.is_contiguous(memory_format=layout)
    torch.testing.assert_close(g_x, leaf.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_w, layer.weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_b, layer.bias.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('bias', [True, False])
@pytest.mark.parametrize('layout', ['nchw', 'channels_last'])
def test_channel_scale_folds_into_the_fused_classifier(bias, layout):
    """``conv(x * s_n)`` with a per-image channel scale (a training
    Dropout2d's noise, zeros included) folded into the 1x1 classifier's
    weight: the same logits as autograd's conv of the scaled input, and the
    fused function's g_x, g_W, g_b equal autograd's through the scaling."""
    fmt = torch.channels_last if layout == 'channels_last' else \
        torch.contiguous_format
    gen = torch.Generator().manual_seed(2)
    x0 = torch.randn(3, 6, 7, 5, generator=gen).contiguous(memory_format=fmt)
    scale = torch.tensor([[1.25, 0, 1.25, 1.25, 0, 1.25],
                          [0, 1.25, 1.25, 1.25, 1.25, 1.25],
                          [1.25] * 6]).view(3, 6, 1, 1)
    layer = torch.nn.Conv2d(6, 4, 1, bias=bias).to(memory_format=fmt)
    spec = ConvSpec.of(layer)
    results = []
    for fused in (False, True):
        layer.zero_grad(set_to_none=True)
        x = x0.clone(memory_format=fmt).requires_grad_(True)
        if fused:
            with torch.no_grad():
                z = channel_scaled_classifier(x, layer.weight, layer.bias,
                                              scale)
            keys = []
            values = FusedClassifierLossFunction.apply(
                x, layer.weight, layer.bias, z, scale, spec, _generic, keys)
            out = dict(zip(keys, values))
        else:
            z = layer(x * scale)
            out = _losses(z)
        (out['loss_a'] * 3.0 + out['loss_b']).backward()
        results.append((z.detach(), out, x.grad,
                        [p.grad for p in layer.parameters()]))
    (want_z, want, want_x, want_p), (got_z, got, got_x, got_p) = results
    torch.testing.assert_close(got_z, want_z, rtol=1e-5, atol=1e-6)
    for key in ('loss_a', 'loss_b'):
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=0)
    assert got_x.is_contiguous(memory_format=fmt)
    assert (got_x[0, [1, 4]] == 0).all()  # dropped channels get nothing
    torch.testing.assert_close(got_x, want_x, rtol=1e-5, atol=1e-6)
    for g, w in zip(got_p, want_p):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_channel_scaled_classifier_is_differentiable_by_autograd():
    """The folded forward itself (what a head whose output is not fused
    differentiates with autograd)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 4, 6, generator=gen, dtype=torch.float64)
    scale = torch.rand(2, 5, 1, 1, generator=gen, dtype=torch.float64)
    weight = torch.randn(3, 5, 1, 1, generator=gen, dtype=torch.float64)
    bias = torch.randn(3, generator=gen, dtype=torch.float64)
    inputs = [t.requires_grad_(True) for t in (x, weight, bias)]
    assert torch.autograd.gradcheck(
        lambda x, w, b: channel_scaled_classifier(x, w, b, scale), inputs)


def test_channel_scale_needs_a_pointwise_classifier():
    layer = torch.nn.Conv2d(4, 3, 3, padding=1)
    x, g_z = torch.randn(2, 4, 5, 5), torch.randn(2, 3, 5, 5)
    scale = torch.ones(2, 4, 1, 1)
    with pytest.raises(ValueError, match='1x1 classifier only'):
        weight_and_bias_gradients(x, layer.weight, g_z, ConvSpec.of(layer),
                                  True, scale)
    with pytest.raises(ValueError, match='1x1 classifier only'):
        input_gradient(g_z, layer.weight, x.shape, ConvSpec.of(layer),
                       channel_scale=scale)
