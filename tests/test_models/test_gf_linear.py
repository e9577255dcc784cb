"""GFLinear and GFMultiheadAttention: drop-in modules sharing Parameters,
exact forwards, the filtered backward on the grid of their source
(docs/gradient_filter.md#linear-layers-on-token-grids). The tests that
take ``device`` also run on CUDA tensors (``pytest -m cuda``)."""
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from mmseg_gf.models import (GFLinear, GFMultiheadAttention, TokenGridSource,
                             is_filterable_linear)
from mmseg_gf.models.gf_conv import GFExactBackwardWarning
from mmseg_gf.ops import TokenGrid, gradient_filtered_linear
from tests.helpers.devices import DEVICES
from tests.helpers.gf_linear_reference import reference_attention


def _grads(out, tensors, grad):
    return torch.autograd.grad(out, tensors, grad)


def test_from_linear_shares_parameters_and_keeps_state_dict_keys():
    plain = nn.Linear(6, 4)
    gf = GFLinear.from_linear(plain, 2, TokenGridSource(TokenGrid(2, 3)))
    assert gf.weight is plain.weight and gf.bias is plain.bias
    assert list(gf.state_dict()) == list(plain.state_dict())
    assert 'radius=2' in repr(gf)
    built = GFLinear(6, 4, bias=False, radius=3)
    assert list(built.state_dict()) == ['weight'] and built.radius == 3


@pytest.mark.parametrize('device', DEVICES)
def test_filters_on_its_source_grid_and_is_exact_forward(device):
    torch.manual_seed(0)
    plain = nn.Linear(6, 4).double().to(device)
    source = TokenGridSource()
    gf = GFLinear.from_linear(plain, 2, source)
    x = torch.randn(2, 13, 6, dtype=torch.float64, device=device,
                    requires_grad=True)
    g = torch.randn(2, 13, 4, dtype=torch.float64, device=device)
    source.set(TokenGrid(3, 4, extra_tokens=1))
    out = gf(x)
    assert torch.equal(out, plain(x))
    got = _grads(out, (x, plain.weight, plain.bias), g)
    want = _grads(
        gradient_filtered_linear(x, plain.weight, plain.bias,
                                 TokenGrid(3, 4, 1), 2),
        (x, plain.weight, plain.bias), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_disabled_and_no_grad_are_exact():
    torch.manual_seed(0)
    plain = nn.Linear(6, 4)
    source = TokenGridSource(TokenGrid(3, 4))
    x = torch.randn(2, 12, 6, requires_grad=True)
    g = torch.randn(2, 12, 4)
    want = _grads(plain(x), (x, plain.weight, plain.bias), g)
    gf = GFLinear.from_linear(plain, 4, source, enabled=False)
    got = _grads(gf(x), (x, plain.weight, plain.bias), g)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    with torch.no_grad():
        assert torch.equal(GFLinear.from_linear(plain, 4, source)(x),
                           plain(x))


def test_no_grid_known_runs_exact_backward_and_warns_once():
    torch.manual_seed(0)
    plain = nn.Linear(6, 4)
    gf = GFLinear.from_linear(plain, 2, TokenGridSource(name='blocks.0'))
    x = torch.randn(2, 12, 6, requires_grad=True)
    g = torch.randn(2, 12, 4)
    with pytest.warns(GFExactBackwardWarning, match='no token grid.*blocks.0'):
        got = _grads(gf(x), (x, ), g)
    assert torch.equal(got[0], _grads(plain(x), (x, ), g)[0])
    with warnings.catch_warnings():
        warnings.simplefilter('error', GFExactBackwardWarning)
        gf(x)  # once per layer


def test_a_grid_that_does_not_fit_the_call_is_refused():
    gf = GFLinear.from_linear(nn.Linear(6, 4), 2,
                              TokenGridSource(TokenGrid(4, 4)))
    with pytest.raises(ValueError, match='12 tokens on axis 1'):
        gf(torch.randn(2, 12, 6, requires_grad=True))


def test_call_plans_follow_the_grid_the_radius_and_the_switch():
    """A call's checks and output patches are decided once per signature
    and again when the grid, the radius or the filter switch changes: the
    gradients are the operator's for the grid and radius of the moment,
    and a grid that no longer fits is refused even after a kept plan."""
    from mmseg_gf.models import call_plans
    torch.manual_seed(0)
    plain = nn.Linear(6, 4).double()
    source = TokenGridSource()
    gf = GFLinear.from_linear(plain, 2, source)
    x = torch.randn(2, 13, 6, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 13, 4, dtype=torch.float64)
    params = (x, plain.weight, plain.bias)
    for grid, radius in [(TokenGrid(3, 4, extra_tokens=1), 2),
                         (TokenGrid(3, 4, extra_tokens=1), 2),
                         (TokenGrid(4, 3, extra_tokens=1), 2),
                         (TokenGrid(4, 3, extra_tokens=1), 3),
                         (TokenGrid(3, 4, trailing_tokens=1), 2)]:
        source.set(grid)
        gf.radius = radius
        got = _grads(gf(x), params, g)
        want = _grads(gradient_filtered_linear(x, plain.weight, plain.bias,
                                               grid, radius), params, g)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert len(call_plans.kept_plans(gf, 'linear_plans')) == 4
    gf.enabled = False
    got = _grads(gf(x), params, g)
    for a, b in zip(got, _grads(plain(x), params, g)):
        assert torch.equal(a, b)
    gf.enabled = True
    source.set(TokenGrid(4, 4))
    with pytest.raises(ValueError, match='13 tokens on axis 1'):
        gf(x)


def test_only_plain_linears_are_wrapped():
    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    assert not is_filterable_linear(Scaled(3, 3))
    with pytest.raises(TypeError, match='Scaled'):
        GFLinear.from_linear(Scaled(3, 3), 2, None)
    out_proj = nn.MultiheadAttention(8, 2).out_proj
    assert is_filterable_linear(out_proj)


def test_registered_in_mmseg_models():
    pytest.importorskip('mmseg')
    from mmseg.registry import MODELS
    layer = MODELS.build(dict(type='GFLinear', in_features=3,
                              out_features=2, radius=2))
    assert isinstance(layer, GFLinear) and layer.radius == 2


# ----------------------------------------------------------------------------
# nn.MultiheadAttention: packed in-projection, out-projection

def _attention_inputs(mode, batch_first, seed=0, device='cpu'):
    """(query, key, value) as mmseg calls the attention: self-attention
    (one tensor), a reduced key/value (MiT, Twins), three distinct tensors
    (mmcv's wrapper transposes each)."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(n):
        t = torch.randn(2, n, 8, generator=gen,
                        dtype=torch.float64).to(device)
        return t if batch_first else t.transpose(0, 1)

    query = tokens(1 + 16).requires_grad_()
    if mode == 'self':
        return query, query, query
    if mode == 'reduced':
        kv = tokens(4).requires_grad_()
        return query, kv, kv
    key = tokens(1 + 16).requires_grad_()
    return query, key, key.detach().clone().requires_grad_()


GRIDS = {
    'self': (TokenGrid(4, 4, 1), None),
    'reduced': (TokenGrid(4, 4, 1), TokenGrid(2, 2)),
    'distinct': (TokenGrid(4, 4, 1), None),
}


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('mode', ['self', 'reduced', 'distinct'])
@pytest.mark.parametrize('batch_first', [False, True])
@pytest.mark.parametrize('need_weights', [True, False])
def test_attention_forward_is_torchs_and_gradients_match_reference(
        mode, batch_first, need_weights, device):
    torch.manual_seed(0)
    plain = nn.MultiheadAttention(8, 2, batch_first=batch_first).double()
    plain = plain.to(device)
    q_grid, k_grid = GRIDS[mode]
    gf = GFMultiheadAttention.from_attention(
        plain, 2, TokenGridSource(q_grid),
        None if k_grid is None else TokenGridSource(k_grid))
    assert list(gf.state_dict()) == list(plain.state_dict())
    assert gf.in_proj_weight is plain.in_proj_weight
    assert gf.out_proj is plain.out_proj
    query, key, value = _attention_inputs(mode, batch_first, device=device)
    out, weights = gf(query, key, value, need_weights=need_weights)
    want, want_weights = plain(query, key, value, need_weights=need_weights)
    assert torch.equal(out, want)  # op for op torch's forward
    assert (weights is None) == (want_weights is None)
    if weights is not None:
        assert torch.equal(weights, want_weights)
    grad = torch.randn(out.shape, dtype=torch.float64).to(device)
    leaves = [plain.in_proj_weight, plain.in_proj_bias,
              plain.out_proj.weight, plain.out_proj.bias, query]
    if key is not query:
        leaves.append(key)
    got = _grads(out, leaves, grad)
    ref = reference_attention(plain, query, key, value, q_grid,
                              k_grid or q_grid, 2)
    torch.testing.assert_close(ref, want, rtol=1e-10, atol=1e-10)
    for a, b in zip(got, _grads(ref, leaves, grad)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_attention_radius_1_is_exact_and_masks_fall_back_with_a_warning():
    torch.manual_seed(0)
    plain = nn.MultiheadAttention(8, 2).double()
    gf = GFMultiheadAttention.from_attention(
        plain, 1, TokenGridSource(TokenGrid(4, 4, 1)))
    query, key, value = _attention_inputs('self', False)
    grad = torch.randn(17, 2, 8, dtype=torch.float64)
    leaves = [plain.in_proj_weight, plain.out_proj.weight, query]
    got = _grads(gf(query, key, value)[0], leaves, grad)
    want = _grads(plain(query, key, value)[0], leaves, grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    mask = torch.zeros(17, 17, dtype=torch.bool)
    with pytest.warns(GFExactBackwardWarning, match='attention masks'):
        out = gf(query, key, value, attn_mask=mask)[0]
    assert torch.equal(out, plain(query, key, value, attn_mask=mask)[0])


def test_attention_under_cpu_autocast_matches_torchs_forward():
    """bf16 autocast: the same forward as nn.MultiheadAttention under
    autocast, float32 gradients for the float32 parameters."""
    torch.manual_seed(0)
    plain = nn.MultiheadAttention(16, 2, batch_first=True)
    gf = GFMultiheadAttention.from_attention(
        plain, 2, TokenGridSource(TokenGrid(4, 4)))
    x = torch.randn(2, 16, 16, requires_grad=True)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = gf(x, x, x)[0]
        want = plain(x, x, x)[0]
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    out.float().square().sum().backward()
    assert plain.in_proj_weight.grad.dtype == torch.float32
    assert x.grad.dtype == torch.float32


@settings(max_examples=25, deadline=None)
@given(heads=st.sampled_from([1, 2]), batch_first=st.booleans(),
       height=st.integers(1, 5), width=st.integers(1, 5),
       extra=st.integers(0, 2), reduced=st.booleans(),
       radius=st.integers(1, 4), batched=st.booleans(),
       need_weights=st.booleans(), seed=st.integers(0, 2**16))
def test_random_attention_calls_match_reference(heads, batch_first, height,
                                                width, extra, reduced,
                                                radius, batched,
                                                need_weights, seed):
    """Random grids (extra tokens, a reduced key grid), batched or not,
    batch_first or not: torch's forward bit for bit, gradients equal to the
    autograd-hook reference (tests/helpers/gf_linear_reference.py)."""
    torch.manual_seed(seed)
    plain = nn.MultiheadAttention(4, heads,
                                  batch_first=batch_first).double()
    q_grid = TokenGrid(height, width, extra)
    k_grid = TokenGrid(max(1, height // 2), max(1, width // 2)) \
        if reduced else q_grid
    gf = GFMultiheadAttention.from_attention(plain, radius,
                                             TokenGridSource(q_grid),
                                             TokenGridSource(k_grid))

    def tokens(n):
        shape = (2, n, 4) if batch_first else (n, 2, 4)
        t = torch.randn(shape, dtype=torch.float64)
        if not batched:
            t = t[0] if batch_first else t[:, 0]
        return t.requires_grad_()

    query = tokens(q_grid.num_tokens)
    key = tokens(k_grid.num_tokens) if reduced else query
    out, weights = gf(query, key, key, need_weights=need_weights)
    want, want_weights = plain(query, key, key, need_weights=need_weights)
    assert torch.equal(out, want)
    if need_weights:
        assert torch.equal(weights, want_weights)
    grad = torch.randn(out.shape, dtype=torch.float64)
    leaves = [plain.in_proj_weight, plain.in_proj_bias,
              plain.out_proj.weight, query] + ([key] if reduced else [])
    got = _grads(out, leaves, grad)
    if not batched:  # the reference takes batched (N, B, C) / (B, N, C)
        query_b = query.unsqueeze(0 if batch_first else 1)
        key_b = key.unsqueeze(0 if batch_first else 1) if reduced else \
            query_b
        ref = reference_attention(plain, query_b, key_b, key_b, q_grid,
                                  k_grid, radius)
        ref = ref.squeeze(0 if batch_first else 1)
    else:
        ref = reference_attention(plain, query, key, key, q_grid, k_grid,
                                  radius)
    for a, b in zip(got, _grads(ref, leaves, grad)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
