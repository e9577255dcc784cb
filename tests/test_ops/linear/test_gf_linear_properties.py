"""Property-based tests of the gradient-filtered linear layer over random
token grids, layouts, token axes, radii and trained parameters, against the
float64 reference (tests/helpers/gf_linear_reference.py)."""
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from mmseg_gf.ops import TokenGrid, gradient_filtered_linear
from tests.helpers.gf_linear_reference import reference_linear_gradients


@st.composite
def linear_cases(draw):
    layout = draw(st.sampled_from(['tokens', 'hwc', 'windows']))
    height, width = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    extra = draw(st.integers(0, 3)) if layout == 'tokens' else 0
    trailing = draw(st.integers(0, 2)) if layout == 'tokens' else 0
    grid = TokenGrid(height, width, extra, layout, trailing)
    grid_axes = ([height, width]
                 if layout == 'hwc' else [grid.num_tokens])
    before = draw(st.lists(st.integers(1, 3), max_size=2))
    after = draw(st.lists(st.integers(1, 3), max_size=1))
    cin, cout = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    return dict(grid=grid, shape=tuple(before + grid_axes + after + [cin]),
                token_dim=len(before), cout=cout,
                radius=draw(st.integers(1, 8)),
                bias=draw(st.booleans()),
                input_grad=draw(st.booleans()),
                weight_grad=draw(st.booleans()),
                dtype=draw(st.sampled_from([torch.float32, torch.float64])),
                seed=draw(st.integers(0, 2**16)))


@settings(max_examples=150, deadline=None)
@given(linear_cases())
def test_random_linear_layers_match_reference(case):
    gen = torch.Generator().manual_seed(case['seed'])
    dtype, grid = case['dtype'], case['grid']
    x = torch.randn(case['shape'], generator=gen, dtype=torch.float64)
    w = torch.randn(case['cout'], case['shape'][-1], generator=gen,
                    dtype=torch.float64)
    b = torch.randn(case['cout'], generator=gen, dtype=torch.float64)
    g = torch.randn(*case['shape'][:-1], case['cout'], generator=gen,
                    dtype=torch.float64)
    xs = x.to(dtype).requires_grad_(case['input_grad'])
    ws = w.to(dtype).requires_grad_(case['weight_grad'])
    bs = b.to(dtype).requires_grad_() if case['bias'] else None
    y = gradient_filtered_linear(xs, ws, bs, grid, case['radius'],
                                 case['token_dim'])
    assert torch.equal(y, F.linear(xs, ws, bs))
    if not y.requires_grad:
        return
    y.backward(g.to(dtype))
    ref = reference_linear_gradients(xs.detach(), ws.detach(), g.to(dtype),
                                     grid.height, grid.width,
                                     grid.extra_tokens, grid.layout,
                                     case['token_dim'], case['radius'],
                                     grid.trailing_tokens)
    tol = dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(
        rtol=1e-4, atol=1e-4)
    for tensor, want, wanted in ((xs, ref[0], case['input_grad']),
                                 (ws, ref[1], case['weight_grad']),
                                 (bs, ref[2], case['bias'])):
        if tensor is None:
            continue
        if not wanted:
            assert tensor.grad is None
            continue
        assert tensor.grad.shape == tensor.shape
        assert tensor.grad.dtype == tensor.dtype
        scale = max(1.0, float(want.abs().max()))
        torch.testing.assert_close(tensor.grad.double(), want,
                                   rtol=tol['rtol'], atol=tol['atol'] * scale)
