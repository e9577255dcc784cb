"""Property-based tests of the operator over random conv settings."""
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from mmseg_gf.ops import gradient_filtered_conv2d
from tests.gf_reference import reference_gradients


@st.composite
def conv_settings(draw):
    groups = draw(st.sampled_from([1, 2, 3]))
    cin = groups * draw(st.integers(1, 3))
    cout = groups * draw(st.integers(1, 3))
    kh, kw = draw(st.integers(1, 7)), draw(st.integers(1, 7))
    sh, sw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    dh, dw = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    ph, pw = draw(st.integers(0, kh)), draw(st.integers(0, kw))
    # Smallest input the conv accepts, plus a little.
    h = max(1, (kh - 1) * dh + 1 - 2 * ph) + draw(st.integers(0, 9))
    w = max(1, (kw - 1) * dw + 1 - 2 * pw) + draw(st.integers(0, 9))
    radius = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**16))
    return dict(groups=groups, cin=cin, cout=cout, kernel=(kh, kw),
                stride=(sh, sw), dilation=(dh, dw), padding=(ph, pw),
                size=(h, w), radius=radius, seed=seed)


@settings(max_examples=120, deadline=None)
@given(conv_settings())
def test_random_convs_match_reference(cfg):
    gen = torch.Generator().manual_seed(cfg['seed'])
    x = torch.randn(2, cfg['cin'], *cfg['size'], generator=gen,
                    dtype=torch.float64, requires_grad=True)
    w = torch.randn(cfg['cout'], cfg['cin'] // cfg['groups'], *cfg['kernel'],
                    generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(cfg['cout'], generator=gen, dtype=torch.float64,
                    requires_grad=True)
    args = (cfg['stride'], cfg['padding'], cfg['dilation'], cfg['groups'])
    out = gradient_filtered_conv2d(x, w, b, *args, radius=cfg['radius'])
    assert torch.equal(out, F.conv2d(x, w, b, *args))
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    out.backward(grad_out)
    for grad, like in ((x.grad, x), (w.grad, w), (b.grad, b)):
        assert grad.shape == like.shape and grad.dtype == like.dtype
        assert grad.device == like.device
    ref_x, ref_w, ref_b = reference_gradients(x, w, grad_out, *args,
                                              cfg['radius'])
    torch.testing.assert_close(x.grad, ref_x, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(w.grad, ref_w, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(b.grad, ref_b, rtol=1e-9, atol=1e-9)
