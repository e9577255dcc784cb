"""The dispatcher: one priority list per operator, the choice cached per
call signature and switch state, explained with every refusal."""
import pytest
import torch

from mmseg_gf.ops import TokenGrid, gradient_filtered_linear
from mmseg_gf.ops.backend import (availability, device_path, dispatch,
                                  extension, switches)
from mmseg_gf.ops.bit_mask import masks as bit_mask
from mmseg_gf.ops.resize import gemm as bilinear_gemm
from mmseg_gf.ops.resized_loss import loss as resized_loss
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
                 'token_patch_sums', 'bit_mask', 'resize', 'resized_loss',
                 'resized_loss_traced', 'frozen_norm', 'frozen_layer_norm',
                 'patch_grid', 'grid_products'):
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


#: A call of each operator registered beside the conv and Linear ones.
def _calls():
    x = torch.randn(2, 3, 4, 4)
    return {'resized_loss': (x, ), 'resized_loss_traced': (x, ),
            'bit_mask': (x, ), 'resize': (x, ),
            'frozen_layer_norm': (x, 1), 'patch_grid': (x, ),
            'grid_products': ()}


def test_each_new_operators_reference_is_last_and_refuses_nothing():
    for name, call in _calls().items():
        op = dispatch.operator(name)
        reference = op.implementations[-1]
        assert reference.name == 'torch', name
        assert reference.refusal(*call) is None, name
        assert len(op.implementations) >= 2, name


@pytest.mark.parametrize('name', ['resized_loss', 'bit_mask', 'resize'])
def test_native_switch_changes_the_explained_path(name):
    """With the compiled kernels on, float32 CPU calls take ``c++`` (where
    built); with ``MMSEG_GF_NATIVE`` off the PyTorch path, and the label
    says why."""
    x = torch.randn(2, 3, 4, 4)
    module = {'resized_loss': 'resized_loss', 'bit_mask': 'bit_mask',
              'resize': 'patch_ops'}[name]
    built = extension.built(module)
    with switches.override(MMSEG_GF_NATIVE=True):
        on = dispatch.explain(name, x)
    assert on.path == ('c++' if built else 'torch')
    with switches.override(MMSEG_GF_NATIVE=False):
        off = dispatch.explain(name, x)
    assert off.path == 'torch'
    reason = 'MMSEG_GF_NATIVE off' if built else \
        f'{extension.NAMES[module]} not built'
    assert dict(off.refusals)['c++'] == reason
    assert off.label().endswith(f'{reason} (c++)')
    assert dispatch.refusal(name, 'c++', x) == (None if built else reason)


def test_resize_gemm_switch_and_dtype_refusals():
    """Inside ``as_on_cuda`` a float32 resize takes the GEMMs; the switch
    off or a float16 tensor names the reason; gemm.usable follows."""
    x = torch.randn(1, 2, 4, 4)
    with device_path.as_on_cuda():
        with switches.override(MMSEG_GF_RESIZE_GEMM=True):
            assert dispatch.explain('resize', x).path == 'gemm'
            assert bilinear_gemm.usable(x)
            assert dict(dispatch.explain('resize', x.half()).refusals)[
                'gemm'] == 'torch.float16 tensor'
        with switches.override(MMSEG_GF_RESIZE_GEMM=False):
            off = dispatch.explain('resize', x)
            assert off.path != 'gemm'
            assert dict(off.refusals)['gemm'] == 'MMSEG_GF_RESIZE_GEMM off'
            assert not bilinear_gemm.usable(x)


def test_resize_kernel_refuses_a_gradient_whose_images_are_strided():
    grad = torch.randn(2, 3, 4, 4).transpose(2, 3)
    explained = dispatch.explain('resize', grad)
    assert explained.path == 'torch'
    if availability.native_available():
        assert dict(explained.refusals)['c++'] == \
            'an image of the gradient not contiguous'


def test_resized_loss_names_its_refusals_and_a_forced_kernel_says_why():
    logits = torch.randn(1, 3, 2, 2)
    label = torch.zeros(1, 4, 4, dtype=torch.int64)
    double = dispatch.explain('resized_loss', logits.double())
    assert double.path == 'torch'
    assert dict(double.refusals)['c++'] in (
        'torch.float64 logits (the kernel takes float32)',
        'mmseg_gf._resized_loss not built', 'MMSEG_GF_NATIVE off')
    assert resized_loss.kernel_usable(logits.double()) is False
    with switches.override(MMSEG_GF_NATIVE=False):
        with pytest.raises(RuntimeError, match='MMSEG_GF_NATIVE off|built'):
            resized_loss.resized_cross_entropy(logits, label,
                                               use_kernel=True)
        traced = dispatch.explain('resized_loss_traced', logits)
    assert traced.path == 'torch'  # torch.compile traces PyTorch's form
    assert dict(traced.refusals)['c++'] in ('MMSEG_GF_NATIVE off',
                                           'mmseg_gf._resized_loss not built')
    if extension.built('resized_loss') and \
            not availability.triton_takes(logits):
        assert dispatch.explain('resized_loss_traced', logits).path == 'c++'
        assert resized_loss.operator_usable(logits)


def test_bit_mask_paths_write_the_same_bytes():
    """The path the dispatcher explains runs, and the bytes equal the
    PyTorch path's (switched off)."""
    x = torch.randn(3, 5, 7)
    bits = bit_mask.pack(x, 0.0)
    with switches.override(MMSEG_GF_NATIVE=False):
        assert dispatch.explain('bit_mask', x).path == 'torch'
        reference = bit_mask.pack(x, 0.0)
    assert torch.equal(bits, reference)
    assert dispatch.explain('bit_mask', x[:, :, ::2]).path == 'torch'


def test_fused_products_switch_changes_the_explained_path():
    with switches.override(MMSEG_GF_FUSED_PRODUCTS=True):
        assert dispatch.explain('grid_products').path == 'fused'
    with switches.override(MMSEG_GF_FUSED_PRODUCTS=False):
        off = dispatch.explain('grid_products')
    assert off.label() == 'torch: MMSEG_GF_FUSED_PRODUCTS off (fused)'
