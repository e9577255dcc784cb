"""Lean Functions whose output a later module modifies in place.

mmcv's ``FFN`` (K-Net's kernel update head) runs ``Linear`` then an
in-place ``ReLU``; ``F.linear`` on a 3-D input with a bias returns a view,
and autograd refuses an in-place change of a view a custom Function returns.
The lean modules give their output back as a tensor of its own
(:func:`mmseg_gf.ops.function_output.owned_output`); where the output is a
view of the input, which cannot be made so exactly, the module runs its
plain forward with one logged line (:func:`mmseg_gf.models.lean.
lean_or_plain`). Both against plain autograd: same output, same input
gradient.
"""
import copy

import pytest
import torch
from torch import nn

from mmseg_gf.models import lean as lean_module
from mmseg_gf.models.lean import is_lean, make_lean
from mmseg_gf.ops.function_output import AliasedOutputError, owned_output
from mmseg_gf.ops.lean.functions import FrozenLinearFunction
from tests.helpers.frozen_modules import frozen_random


def _step(model: nn.Module, x0: torch.Tensor, grad: torch.Tensor):
    x = x0.clone().requires_grad_(True)
    out = model(x * 1.0)
    out.backward(grad)
    return out.detach(), x.grad


def _lean_copy(model: nn.Module, expected: int) -> nn.Module:
    lean = copy.deepcopy(model)
    swapped = [m for m in lean.modules() if make_lean(m) is not None]
    assert len(swapped) == expected and all(is_lean(m) for m in swapped)
    return lean


@pytest.mark.parametrize('act', [nn.ReLU, nn.ReLU6, nn.LeakyReLU])
def test_in_place_activation_after_frozen_linear(act):
    """The FFN pattern: frozen Linear (3-D input, bias) -> in-place
    activation -> Linear; the Linear's output is a view inside F.linear."""
    plain = frozen_random(nn.Sequential(nn.Linear(8, 6), act(inplace=True),
                                  nn.Linear(6, 4)))
    gen = torch.Generator().manual_seed(1)
    x0 = torch.randn(2, 5, 8, generator=gen)
    grad = torch.randn(2, 5, 4, generator=gen)
    lean = _lean_copy(plain, 3)
    ref_out, ref_grad = _step(plain, x0, grad)
    out, g = _step(lean, x0, grad)
    assert torch.equal(out, ref_out)
    torch.testing.assert_close(g, ref_grad, rtol=1e-6, atol=1e-6)
    assert '_gf_lean_off' not in lean[0].__dict__  # the lean path ran


def test_owned_output_of_an_inner_view_is_the_same_memory():
    base = torch.randn(6, 4)
    view = base.view(2, 3, 4)
    t = base.t()  # a strided view: shape and strides kept
    for v in (view, t):
        out = owned_output(v, torch.randn(3))
        assert out._base is None
        assert out.data_ptr() == v.data_ptr()
        assert out.stride() == v.stride() and torch.equal(out, v)
    plain = torch.randn(3)
    assert owned_output(plain) is plain


def test_owned_output_refuses_a_view_of_an_input():
    x = torch.randn(4, 6)
    with pytest.raises(AliasedOutputError, match='view of its input'):
        owned_output(x[1:], x)
    with pytest.raises(AliasedOutputError):  # views of one base
        owned_output(x[2:], x[:1])


def test_frozen_linear_function_output_takes_in_place_use():
    w = torch.randn(6, 8)
    b = torch.randn(6)
    x = torch.randn(2, 5, 8, requires_grad=True)
    y = FrozenLinearFunction.apply(
        x, w, lambda t: torch.nn.functional.linear(t, w, b))
    assert y._base is None
    torch.relu_(y).sum().backward()
    ref = torch.nn.functional.linear(x, w, b)
    expected, = torch.autograd.grad(torch.relu(ref).sum(), x)
    torch.testing.assert_close(x.grad, expected, rtol=1e-6, atol=1e-6)


class _CornerPool(nn.AdaptiveAvgPool2d):
    """A pool whose forward returns a view of its input (its top-left
    corner): a lean kind (``pool``) whose output cannot be owned."""

    def forward(self, x):
        return x[:, :, :self.output_size, :self.output_size]


def test_view_of_the_input_falls_back_with_one_line(monkeypatch):
    lines = []
    monkeypatch.setattr(lean_module, 'print_log',
                        lambda msg, **_: lines.append(msg))
    monkeypatch.setattr(lean_module, '_FALLBACKS_LOGGED', set())
    plain = nn.Sequential(_CornerPool(3), nn.ReLU(inplace=True))
    gen = torch.Generator().manual_seed(2)
    x0 = torch.randn(2, 3, 5, 5, generator=gen)
    grad = torch.randn(2, 3, 3, 3, generator=gen)
    lean = _lean_copy(plain, 2)
    ref_out, ref_grad = _step(plain, x0, grad)
    for _ in range(2):
        out, g = _step(lean, x0, grad)
        assert torch.equal(out, ref_out)
        assert torch.equal(g, ref_grad)
    assert 'view of its input' in lean[0].__dict__['_gf_lean_off']
    assert len(lines) == 1 and 'Lean_CornerPool' in lines[0], lines
