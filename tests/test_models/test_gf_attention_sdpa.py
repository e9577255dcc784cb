"""GFMultiheadAttention through SDPA when its weights are unused, and what a
trained token layer keeps for backward, against autograd's saved tensors
(mmseg_gf/accounting/kept_tokens.py).

``_gf_lean_weights_unused`` is what mmcv's MultiheadAttention wrapper, made
lean, sets around its call (it discards the weights). Then the filtered
(and the exact, ``enabled=False``) attention runs
``scaled_dot_product_attention``: the output equals torch's
``need_weights=True`` call within 1e-12 (float64; SDPA sums in another
order), the gradients equal the same module's ``bmm`` path within 1e-10,
and no ``L x S`` tensor is kept. With dropout on the probabilities in
training the ``bmm`` path runs (torch's draws). The SDPA-versus-``bmm``
test also runs on CUDA tensors (``pytest -m cuda``): there float64 SDPA
runs PyTorch's math backend, which keeps the probabilities, so only the
numbers and the ``bmm`` path's kept probabilities are checked on CUDA.
"""
import pytest
import torch
from torch import nn

from mmseg_gf.accounting.kept_tokens import patch_sum_elements, token_items
from mmseg_gf.accounting.measured import saved_tensor_bytes
from mmseg_gf.models import GFLinear, GFMultiheadAttention, TokenGridSource
from mmseg_gf.ops import TokenGrid, gradient_filtered_linear
from tests.helpers.devices import DEVICES

Q_GRID = TokenGrid(4, 4, 1)
K_GRID = TokenGrid(2, 3)  # S = 6: no (L, S) shape is (L, head dim)


def _inputs(mode, batch_first, batch=2, device='cpu'):
    gen = torch.Generator().manual_seed(1)

    def tokens(n):
        shape = (batch, n, 8) if batch_first else (n, batch, 8)
        return torch.randn(shape, generator=gen,
                           dtype=torch.float64).to(device).requires_grad_()

    query = tokens(Q_GRID.num_tokens)
    if mode == 'self':
        return query, query, query
    if mode == 'reduced':
        kv = tokens(K_GRID.num_tokens)
        return query, kv, kv
    key = tokens(Q_GRID.num_tokens)
    return query, key, tokens(Q_GRID.num_tokens)


def _attention(mode, batch_first, enabled, radius=2, dropout=0.0,
               device='cpu'):
    torch.manual_seed(0)
    plain = nn.MultiheadAttention(8, 2, dropout=dropout,
                                  batch_first=batch_first).double().to(device)
    key_grid = K_GRID if mode == 'reduced' else Q_GRID
    gf = GFMultiheadAttention.from_attention(
        plain, radius, TokenGridSource(Q_GRID), TokenGridSource(key_grid),
        enabled=enabled)
    return plain, gf


def _grads(out, leaves, grad):
    return torch.autograd.grad(out, leaves, grad)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('enabled', [True, False])
@pytest.mark.parametrize('mode', ['self', 'reduced', 'distinct'])
@pytest.mark.parametrize('batch_first', [False, True])
def test_unused_weights_run_sdpa_with_the_bmm_paths_numbers(
        mode, batch_first, enabled, device):
    plain, gf = _attention(mode, batch_first, enabled, device=device)
    query, key, value = _inputs(mode, batch_first, device=device)
    leaves = [plain.in_proj_weight, plain.in_proj_bias,
              plain.out_proj.weight, plain.out_proj.bias, query]
    if key is not query:
        leaves.append(key)
    out_bmm, weights = gf(query, key, value)
    assert weights is not None and gf._gf_lean_call is None
    gf._gf_lean_weights_unused = True
    out, none = gf(query, key, value)
    assert none is None and gf._gf_lean_call is not None
    want = plain(query, key, value)[0]
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    grad = torch.randn(out.shape, dtype=torch.float64).to(device)
    for a, b in zip(_grads(out, leaves, grad),
                    _grads(out_bmm, leaves, grad)):
        assert a.device == b.device == out.device
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    # no L x S tensor is kept (the bmm path keeps the probabilities); CUDA's
    # float64 SDPA is the math backend, which keeps them
    probabilities = (Q_GRID.num_tokens, key.shape[1 if batch_first else 0])
    if device == 'cpu':
        assert probabilities not in _saved_shapes(
            lambda: gf(query, key, value))
    gf._gf_lean_weights_unused = False
    assert probabilities in _saved_shapes(lambda: gf(query, key, value))


def _saved_shapes(forward):
    """The last two sizes of every tensor autograd saves in ``forward``."""
    shapes = set()

    def pack(t):
        shapes.add(tuple(t.shape[-2:]))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return shapes


def test_dropout_on_the_probabilities_keeps_torchs_draws():
    plain, gf = _attention('self', False, True, radius=1, dropout=0.5)
    gf.train()
    gf._gf_lean_weights_unused = True
    query, key, value = _inputs('self', False)
    torch.manual_seed(3)
    out, weights = gf(query, key, value)
    torch.manual_seed(3)
    want, want_weights = plain(query, key, value)
    assert gf._gf_lean_call is None and gf._gf_probabilities_call.dropout
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(weights, want_weights, rtol=0, atol=0)


def _rule_bytes(path, module, x, out, batch):
    items = token_items(path, module, x, out, {})
    return sum(i.nbytes(batch) for i in items)


@pytest.mark.parametrize('token_dim,batch', [(0, 1), (0, 2), (1, 1),
                                             (1, 2)])
def test_a_filtered_linear_keeps_patch_sums_and_its_extra_tokens(token_dim,
                                                                 batch):
    """Its extra tokens are a copy: a contiguous narrow (token axis first,
    or one image) would keep the whole input's storage."""
    grid = TokenGrid(5, 3, extra_tokens=1, trailing_tokens=2)
    x = torch.randn(batch, grid.num_tokens, 6)
    if token_dim == 0:
        x = x.transpose(0, 1).contiguous()
    weight = nn.Parameter(torch.randn(4, 6))
    kept = saved_tensor_bytes(lambda: gradient_filtered_linear(
        x, weight, None, grid, 2, token_dim))
    # sums on ceil(5/2) x ceil(3/2) patches, plus 3 tokens on no grid
    assert kept == batch * (3 * 2 + 3) * 6 * 4
    assert patch_sum_elements(grid, 2, x.numel(), 6) * 4 == kept


@pytest.mark.parametrize('enabled', [True, False])
def test_the_rule_of_a_trained_linear_is_what_autograd_keeps(enabled):
    """At batch 1, as the step tracer runs: the filtered layer's patch sums
    and extra tokens; the exact one's input and a view of its weight."""
    source = TokenGridSource(TokenGrid(4, 4, extra_tokens=1))
    gf = GFLinear.from_linear(nn.Linear(6, 4), 4, source, enabled=enabled)
    x = torch.randn(1, 17, 6, requires_grad=True)
    out = gf(x)
    kept = saved_tensor_bytes(lambda: gf(x))
    assert _rule_bytes('fc', gf, x, out, 1) == kept
    if enabled:
        assert kept == (1 + 1) * 6 * 4  # one 4x4 patch, one cls token
    else:
        assert kept == x.numel() * 4 + gf.weight.numel() * 4


@pytest.mark.parametrize('enabled', [True, False])
@pytest.mark.parametrize('mode', ['self', 'reduced', 'distinct'])
def test_the_rule_of_a_trained_attention_is_what_autograd_keeps(mode,
                                                                enabled):
    """SDPA and ``bmm`` paths, filtered and exact, batch 1 (the module's
    own tensors only: its inputs here are leaves nobody else keeps)."""
    plain, gf = _attention(mode, True, enabled)
    query, key, value = _inputs(mode, True, batch=1)
    for unused in (True, False):
        gf._gf_lean_weights_unused = unused
        out = gf(query, key, value)[0]
        kept = saved_tensor_bytes(lambda: gf(query, key, value))
        assert _rule_bytes('attn', gf, query, out, 1) == kept, (mode,
                                                                unused)
