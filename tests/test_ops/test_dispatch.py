"""The dispatcher: one priority list per operator, the choice cached per
call signature and switch state, explained with every refusal."""
import pytest
import torch

from mmseg_gf.ops import TokenGrid, gradient_filtered_linear
from mmseg_gf.ops.backend import dispatch, switches
from tests.helpers import standin_linear


def _linear_grads(dtype):
    torch.manual_seed(0)
    x = torch.randn(2, 16, 6, dtype=dtype, requires_grad=True)
    w = torch.randn(5, 6, dtype=dtype, requires_grad=True)
    b = torch.randn(5, dtype=dtype, requires_grad=True)
    out = gradient_filtered_linear(x, w, b, TokenGrid(4, 4), radius=2)
    out.backward(torch.randn_like(out))
    return x.grad, w.grad, b.grad


@pytest.fixture
def stand_in():
    op = dispatch.operator('linear_backward')
    op.add(standin_linear.STAND_IN, before=op.implementations[0].name)
    standin_linear.calls.clear()
    yield op
    op.remove('stand-in')


def test_a_registered_backend_is_chosen_explained_and_refused(stand_in):
    """First in the list, the stand-in runs float32 calls (the gradients
    those of the list without it), is named by explain, and refuses
    float64 calls with its reason."""
    chosen = _linear_grads(torch.float32)
    assert standin_linear.calls
    stand_in.remove('stand-in')
    without = _linear_grads(torch.float32)
    stand_in.add(standin_linear.STAND_IN,
                 before=stand_in.implementations[0].name)
    for a, e in zip(chosen, without):
        torch.testing.assert_close(a, e)
    rows = torch.zeros(1, 4, 4, 5)
    call = (None, rows, None, torch.zeros(5, 6), None, False, True,
            torch.float32)
    assert stand_in.explain(*call).path == 'stand-in'
    standin_linear.calls.clear()
    _linear_grads(torch.float64)
    assert not standin_linear.calls
    refused = stand_in.explain(None, rows.double(), None,
                               torch.zeros(5, 6).double(), None, False, True,
                               torch.float64)
    assert refused.path != 'stand-in'
    assert ('stand-in', 'stand-in takes float32, got torch.float64') in \
        refused.refusals


def test_the_reference_is_last_and_refuses_nothing():
    for name in ('conv', 'conv_backward', 'linear_backward',
                 'token_patch_sums'):
        op = dispatch.operator(name)
        assert op.implementations[-1].name == 'torch'


def test_choices_are_cached_per_signature_and_bounded():
    op = dispatch.operator('token_patch_sums')
    op.cache_clear()
    seen = []

    class Layout:
        radius = 2

        def pool_rows(self, rows, dtype):
            return rows

    probe = dispatch.Implementation(
        'probe', lambda layout, rows, dtype: seen.append(rows.shape) or
        'probe refuses', None)
    op.add(probe, before=op.implementations[0].name)
    try:
        rows = torch.zeros(1, 4, 4, 3)
        for _ in range(3):
            op.choose(Layout(), rows, torch.float32)
        assert len(seen) == 1  # walked once for the signature
        assert op.cache_info()['hits'] >= 2
        with switches.override(MMSEG_GF_NATIVE=False):
            op.choose(Layout(), rows, torch.float32)
        assert len(seen) == 2  # a switch is part of the key
        for size in range(dispatch.CACHE_SIZE + 5):
            op.choose(Layout(), torch.zeros(1, 1, size + 1, 1),
                      torch.float32)
        assert op.cache_info()['size'] == dispatch.CACHE_SIZE
    finally:
        op.remove('probe')
    assert 'token_patch_sums' in dispatch.cache_info()


def test_explain_names_the_conv_path_and_its_refusals():
    x = torch.randn(1, 2, 6, 6)
    w = torch.randn(3, 2, 3, 3)
    dilated = dispatch.explain('conv', x, w, None, (1, 1), (4, 4), (4, 4), 1,
                               2)
    assert dilated.path == 'torch'
    assert dict(dilated.refusals)['c++'] in (
        'dilated taps reach other patches', 'mmseg_gf._patch_ops not built',
        'MMSEG_GF_NATIVE off')
    with switches.override(MMSEG_GF_NATIVE=False):
        off = dispatch.explain('conv', x, w, None, (1, 1), (1, 1), (1, 1), 1,
                               2)
    assert off.path == 'torch'
    assert off.label().startswith('torch: ')
    assert dict(off.refusals)['c++'] in ('MMSEG_GF_NATIVE off',
                                         'mmseg_gf._patch_ops not built')


def test_an_unknown_operator_names_the_registered_ones():
    with pytest.raises(KeyError, match='conv'):
        dispatch.operator('no such operator')
    with pytest.raises(ValueError, match='already'):
        dispatch.operator('conv').add(
            dispatch.Implementation('torch', lambda *call: None))
