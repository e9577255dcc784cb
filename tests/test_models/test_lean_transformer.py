"""The lean layers of transformer blocks against the plain modules.

Each lean module (:mod:`mmseg_gf.models.lean_transformer`) is checked
against the same module with its plain class: forward and the gradient
w.r.t. its inputs (float32; attention through SDPA sums in another order:
``atol`` 1e-6 on values of order 1, ``rtol`` 1e-5; LayerNorm's forward
bit for bit), and what autograd keeps for backward
(:func:`~mmseg_gf.accounting.measured.saved_tensor_bytes`) against the
bytes the accounting's rules give.

The tests that take ``device`` also run on CUDA tensors (``pytest -m
cuda``): forward and gradients as on the CPU; the kept bytes of attention
are checked on the CPU only (the accounting's rule is that of PyTorch's
CPU flash kernel; CUDA's SDPA backends keep other statistics).
"""
import copy

import pytest
import torch
from torch import nn

from mmseg_gf.accounting.measured import saved_tensor_bytes
from mmseg_gf.models.lean import is_lean, lean_kind, make_lean, make_plain
from mmseg_gf.ops.lean.transformer import attention_kept_elements
from tests.helpers.devices import DEVICES

TOL = dict(rtol=1e-5, atol=1e-6)


def _frozen(module: nn.Module) -> nn.Module:
    for p in module.parameters():
        p.requires_grad_(False)
    return module


def _lean_copy(module: nn.Module) -> nn.Module:
    lean = copy.deepcopy(module)
    for m in lean.modules():
        make_lean(m)
    return lean


def _grads(fn, inputs, seed=3):
    """Output, gradients of a fixed random projection w.r.t. ``inputs``,
    bytes autograd keeps."""
    holder = {}

    def forward():
        holder['out'] = fn()

    kept = saved_tensor_bytes(forward)
    out = holder['out']
    out = out[0] if isinstance(out, tuple) else out
    g = torch.randn(out.shape,
                    generator=torch.Generator().manual_seed(seed)).to(
                        out.device, out.dtype)
    grads = torch.autograd.grad(out, inputs, g)
    return out.detach(), grads, kept


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('affine', [True, False])
@pytest.mark.parametrize('contiguous', [True, False])
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_layer_norm_keeps_input_and_rstd(affine, contiguous, dtype, device):
    torch.manual_seed(0)
    plain = _frozen(nn.LayerNorm(24, eps=1e-6, elementwise_affine=affine))
    if affine:
        with torch.no_grad():
            plain.weight.normal_()
            plain.bias.normal_()
    plain = plain.to(device, dtype)
    lean = _lean_copy(plain)
    assert is_lean(lean) and lean_kind(lean) == 'layer_norm'
    base = torch.randn(2, 24, 35, dtype=dtype).to(device) * 3 + 1
    x = (base if not contiguous else base.transpose(1, 2).contiguous())
    x = x.transpose(1, 2) if not contiguous else x
    x.requires_grad_(True)
    want, (g_want, ), kept_plain = _grads(lambda: plain(x), [x])
    got, (g_got, ), kept = _grads(lambda: lean(x), [x])
    assert torch.equal(got, want)
    torch.testing.assert_close(g_got, g_want, **TOL)
    tokens = 2 * 35
    stat = 8 if dtype == torch.float64 else 4
    assert kept == x.untyped_storage().nbytes() + tokens * stat
    assert kept_plain == kept + tokens * stat  # autograd: the mean too


def test_layer_norm_trained_or_unrecorded_is_plain():
    norm = nn.LayerNorm(8)
    lean = _lean_copy(norm)
    x = torch.randn(3, 8, requires_grad=True)
    out = lean(x)
    assert 'NativeLayerNorm' in type(out.grad_fn).__name__
    _frozen(lean)
    with torch.no_grad():
        assert lean(x).grad_fn is None
    assert make_plain(lean) and type(lean) is nn.LayerNorm


def test_layer_norm_weight_changed_in_place_is_an_error():
    lean = _lean_copy(_frozen(nn.LayerNorm(8)))
    x = torch.randn(3, 8, requires_grad=True)
    out = lean(x)
    with torch.no_grad():
        lean.weight.mul_(2)
    with pytest.raises(RuntimeError, match='modified in place'):
        out.sum().backward()


def _attention(embed, heads, bias, batch_first, kdim=None):
    torch.manual_seed(1)
    module = nn.MultiheadAttention(embed, heads, bias=bias,
                                   batch_first=batch_first, kdim=kdim,
                                   vdim=kdim)
    return _frozen(module)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('batch_first', [True, False])
@pytest.mark.parametrize('case', ['self', 'reduced_kv', 'separate_kv',
                                  'no_bias', 'kdim'])
def test_multihead_attention_through_sdpa(batch_first, case, device):
    embed, heads, q_len, kv_len, batch = 16, 2, 20, 6, 2
    kdim = 12 if case == 'kdim' else None
    plain = _attention(embed, heads, case != 'no_bias', batch_first,
                       kdim).to(device)
    lean = _lean_copy(plain)
    assert lean_kind(lean) == 'attention'

    def seq(n, dim, seed):
        shape = (batch, n, dim) if batch_first else (n, batch, dim)
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(shape, generator=gen).to(device).requires_grad_()

    query = seq(q_len, embed, 2)
    if case == 'self':
        key = value = query
    elif case in ('reduced_kv', 'no_bias'):
        key = value = seq(kv_len, embed, 3)
    else:
        key, value = seq(kv_len, kdim or embed, 3), seq(kv_len, kdim or
                                                         embed, 4)
    inputs = list({id(t): t for t in (query, key, value)}.values())
    want, g_want, kept_plain = _grads(
        lambda: plain(query, key, value, need_weights=False), inputs)
    got, g_got, kept = _grads(
        lambda: lean(query, key, value, need_weights=False), inputs)
    torch.testing.assert_close(got, want, **TOL)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, **TOL)
    s = q_len if case == 'self' else kv_len
    assert lean._gf_lean_call.batch == batch and lean._gf_lean_call.kv_len == s
    if device == 'cpu':
        elems = attention_kept_elements(batch, q_len, s, embed, heads)
        assert kept == 4 * sum(elems.values())
        # torch's own SDPA path also keeps its weight views (whole
        # Parameters)
        assert kept < kept_plain


def test_multihead_attention_weights_asked_run_plain():
    plain = _attention(16, 2, True, True)
    lean = _lean_copy(plain)
    x = torch.randn(2, 10, 16, requires_grad=True)
    out, weights = lean(x, x, x)
    assert weights is not None and lean._gf_lean_call is None
    want, _ = plain(x, x, x)
    assert torch.equal(out, want)
    # asked by mmcv's wrapper (below) or need_weights=False: lean
    lean._gf_lean_weights_unused = True
    out, weights = lean(x, x, x)
    assert weights is None and lean._gf_lean_call is not None
    torch.testing.assert_close(out, want, **TOL)


def test_multihead_attention_versus_probabilities():
    """The step's attention keeps no ``L x S`` tensor: against the plain
    module with ``need_weights=True`` (mmseg's call), which keeps the
    probabilities."""
    plain = _attention(16, 2, True, True)
    lean = _lean_copy(plain)
    lean._gf_lean_weights_unused = True
    x = torch.randn(2, 512, 16, requires_grad=True)
    want, g_want, kept_plain = _grads(lambda: plain(x, x, x), [x])
    got, g_got, kept = _grads(lambda: lean(x, x, x), [x])
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(g_got[0], g_want[0], **TOL)
    probabilities = 2 * 2 * 512 * 512 * 4
    assert kept_plain > probabilities > 8 * kept


def test_mmcv_wrapper_marks_weights_unused():
    transformer = pytest.importorskip('mmcv.cnn.bricks.transformer')
    torch.manual_seed(0)
    plain = _frozen(transformer.MultiheadAttention(16, 2, batch_first=True))
    lean = _lean_copy(plain)
    assert lean_kind(lean) == 'attention' and is_lean(lean.attn)
    x = torch.randn(2, 12, 16, requires_grad=True)
    want, (g_want, ), kept_plain = _grads(lambda: plain(x), [x])
    got, (g_got, ), kept = _grads(lambda: lean(x), [x])
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(g_got, g_want, **TOL)
    assert lean.attn._gf_lean_call is not None
    assert not lean.attn._gf_lean_weights_unused
    elems = attention_kept_elements(2, 12, 12, 16, 2)
    assert kept == 4 * sum(elems.values()) < kept_plain


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('drop_prob', [0.0, 0.3])
def test_drop_path_keeps_a_bit_per_sample(drop_prob, device):
    drop = pytest.importorskip('mmcv.cnn.bricks.drop')
    plain = drop.DropPath(drop_prob)
    lean = _lean_copy(plain)
    assert lean_kind(lean) == 'drop_path'
    x = torch.randn(9, 5, 4, device=device, requires_grad=True)
    torch.manual_seed(7)
    want, (g_want, ), kept_plain = _grads(lambda: plain(x), [x])
    torch.manual_seed(7)
    got, (g_got, ), kept = _grads(lambda: lean(x), [x])
    assert torch.equal(got, want) and torch.equal(g_got, g_want)
    assert kept == (0 if drop_prob == 0 else 2)  # ceil(9 / 8) bytes
    assert kept_plain == (0 if drop_prob == 0 else 9 * 4)


def test_mmcv_dropout_is_lean_as_torch_dropout():
    drop = pytest.importorskip('mmcv.cnn.bricks.drop')
    lean = _lean_copy(drop.Dropout(0.4))
    assert lean_kind(lean) == 'dropout' and is_lean(lean)
    x = torch.randn(4, 64, requires_grad=True)
    torch.manual_seed(3)
    want = nn.functional.dropout(x, 0.4, True)
    torch.manual_seed(3)
    _, _, kept = _grads(lambda: lean(x), [x])
    torch.manual_seed(3)
    assert torch.equal(lean(x), want) and kept == 4 * 64 // 8


def _swin_window(shifted: bool, device='cpu'):
    swin = pytest.importorskip('mmseg.models.backbones.swin')
    torch.manual_seed(0)
    module = swin.WindowMSA(16, 2, (4, 4))
    with torch.no_grad():
        module.relative_position_bias_table.normal_()
    return _frozen(module).to(device), swin


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('shifted', [False, True])
def test_swin_window_attention_through_sdpa(shifted, device):
    plain, _ = _swin_window(shifted, device)
    lean = _lean_copy(plain)
    assert lean_kind(lean) == 'attention'
    n_win, images, n = 3, 2, 16
    x = torch.randn(images * n_win, n, 16, device=device, requires_grad=True)
    mask = None
    if shifted:
        mask = torch.zeros(n_win, n, n, device=device)
        mask[1, :8, 8:] = mask[1, 8:, :8] = -100.0
    want, (g_want, ), kept_plain = _grads(lambda: plain(x, mask), [x])
    got, (g_got, ), kept = _grads(lambda: lean(x, mask), [x])
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(g_got, g_want, **TOL)
    call = lean._gf_lean_call
    if device != 'cpu':
        assert call is not None
        return
    tokens = images * n_win * n
    per_call = 4 * (4 * tokens * 16 + tokens * 2)
    mask_bytes = 4 * (n_win if shifted else 1) * 2 * n * n
    assert call.mask_elements * call.mask_bytes == mask_bytes
    assert kept == per_call + mask_bytes
    assert kept < kept_plain


@pytest.mark.parametrize('device', DEVICES)
def test_twins_lsa_through_sdpa(device):
    twins = pytest.importorskip('mmseg.models.backbones.twins')
    torch.manual_seed(0)
    plain = _frozen(twins.LocallyGroupedSelfAttention(16, 2, window_size=4))
    plain = plain.to(device)
    lean = _lean_copy(plain)
    for hw in ((8, 8), (6, 7)):  # no padding; padding on both sides
        x = torch.randn(2, hw[0] * hw[1], 16, device=device,
                        requires_grad=True)
        want, (g_want, ), kept_plain = _grads(lambda: plain(x, hw), [x])
        got, (g_got, ), kept = _grads(lambda: lean(x, hw), [x])
        torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(g_got, g_want, **TOL)
        assert lean._gf_lean_call is not None
        assert kept < kept_plain or device != 'cpu'


def test_subclass_with_its_own_forward_stays_plain():
    """A lean mixin replaces ``forward``: a subclass with a forward of its
    own (a channels-first LayerNorm) is left as it is."""

    class ChannelsFirstNorm(nn.LayerNorm):
        def forward(self, x):
            return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)

    class PlainSubclass(nn.LayerNorm):
        pass

    assert lean_kind(ChannelsFirstNorm(4)) is None
    assert lean_kind(PlainSubclass(4)) == 'layer_norm'
