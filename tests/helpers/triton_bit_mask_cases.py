"""Cases of the bit masks' Triton path (``mmseg_gf.ops.bit_mask.gpu``);
run by ``tests/test_ops/lean/test_lean_triton.py`` in a subprocess.

Not collected on its own (see ``tests/helpers/triton_cases.py``). Run
directly::

    TRITON_INTERPRET=1 python -m pytest -q \
        tests/helpers/triton_bit_mask_cases.py

Each case compares the Triton path with the PyTorch path
(``tests.helpers.triton_runs.pytorch_path``) and with an independent
reference (numpy's ``packbits``, plain autograd modules): bytes and
gradients bit for bit.
Tiny tensors: the interpreter runs every program in Python.
"""
import copy

import numpy as np
import pytest
import torch
from torch import nn

from mmseg_gf.models.lean import make_lean
from mmseg_gf.ops.bit_mask import (masks as bit_mask,
                                   kernels as triton_bit_mask_kernels)
from mmseg_gf.ops.lean.transformer import BitMaskDropPathFunction
from tests.helpers.triton_runs import case_device, pytorch_path, triton_enabled
from mmseg_gf.accounting.launches import LaunchCounter

DEVICE = case_device()

# (lo, hi, nan_bit): ReLU, ReLU6, LeakyReLU / PReLU, Hardsigmoid
BOUNDS = [(0.0, None, True), (0.0, 6.0, True), (0.0, None, False),
          (-3.0, 3.0, False)]


def _values(shape, dtype=torch.float32, seed=0):
    """Random values with the bounds, +-0, +-inf and NaN mixed in; a size
    that is not a multiple of 8 leaves the last byte part-used."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * 4
    flat = x.view(-1)
    specials = torch.tensor([0.0, -0.0, 3.0, -3.0, 6.0, 1e-30, float('inf'),
                             -float('inf'), float('nan')])
    flat[torch.randperm(flat.numel(), generator=gen)[:9]] = specials
    return x.to(dtype)


def _reference_bits(x, lo, hi, nan_bit):
    v = x.detach().float().cpu().numpy().reshape(-1)
    with np.errstate(invalid='ignore'):
        bit = (v > lo) & (True if hi is None else v < hi)
    bit = np.where(np.isnan(v), nan_bit, bit)
    return torch.from_numpy(np.packbits(bit, bitorder='little'))


@pytest.mark.parametrize('dtype', [torch.float32, torch.float16,
                                   torch.bfloat16])
@pytest.mark.parametrize('bounds', BOUNDS, ids=str)
def test_pack_writes_the_reference_bytes(bounds, dtype):
    x = _values((3, 5, 7), dtype)
    want = _reference_bits(x, *bounds)
    on_device = x.to(DEVICE)  # the copy is not the operation's launch
    counter = _count(lambda: bit_mask.pack(on_device, *bounds))
    assert torch.equal(counter.result.cpu(), want)
    assert counter.triton == ['_pack'] and counter.ops == []
    with pytorch_path():
        assert torch.equal(bit_mask.pack(x, *bounds), want)


@pytest.mark.parametrize('off_scale', [0.0, 0.01])
@pytest.mark.parametrize('dtype', [torch.float32, torch.float16])
def test_apply_equals_the_pytorch_path(off_scale, dtype):
    """Gradients with inf / NaN: an exact 0 where the bit is off and the
    scale 0, ``g * scale`` (rounded once) otherwise."""
    x, g = _values((2, 3, 5, 7), seed=1), _values((2, 3, 5, 7), dtype, 2)
    bits = bit_mask.pack(x, 0.0)
    with pytorch_path():
        want = bit_mask.apply(g, bits, off_scale)
    g_on, bits_on = g.to(DEVICE), bits.to(DEVICE)
    counter = _count(lambda: bit_mask.apply(g_on, bits_on, off_scale))
    assert counter.triton == ['_apply'] and counter.ops == []
    _assert_equal(counter.result.cpu(), want)


ACTIVATIONS = {
    'relu': lambda: nn.ReLU(),
    'relu_inplace': lambda: nn.ReLU(inplace=True),
    'relu6': lambda: nn.ReLU6(),
    'hardtanh': lambda: nn.Hardtanh(-1.5, 2.0),
    'leaky_relu': lambda: nn.LeakyReLU(0.1),
    'hardsigmoid': lambda: nn.Hardsigmoid(),
}


@pytest.mark.parametrize('channels_last', [False, True])
@pytest.mark.parametrize('name', sorted(ACTIVATIONS))
def test_lean_activation_equals_plain(name, channels_last):
    """The lean module on the Triton path: the plain module's output and
    input gradient bit for bit, in the input's layout; ReLU / ReLU6 /
    Hardtanh / LeakyReLU in one launch each way (output and bits in one
    pass), the others one launch more (the activation, torch's own)."""
    plain = ACTIVATIONS[name]()
    lean = _lean(plain)
    x0 = _values((2, 3, 4, 5), seed=3)
    g = _values((2, 3, 4, 5), seed=4)
    if channels_last:
        x0, g = (t.contiguous(memory_format=torch.channels_last)
                 for t in (x0, g))
    x0, g = x0.to(DEVICE), g.to(DEVICE)  # the copies are not counted
    # References on the same device: CUDA's and the CPU's torch kernels
    # round Hardsigmoid differently.
    with pytorch_path():
        want = _forward_backward(_lean(plain), x0, g)
    forward, backward = _forward_backward(lean, x0, g, count=True)
    for a, b in zip(forward.result, want):
        _assert_equal(a.cpu(), b.cpu())
    assert forward.result[0].stride() == want[0].stride()
    # autograd's own: torch's vectorised CPU hardtanh_backward zeroes the
    # gradient of a NaN, its scalar loop and CUDA's pass it (as the lean
    # rule does): compared where x is not NaN
    number = ~x0.isnan().cpu()
    for a, b in zip(forward.result, _forward_backward(plain, x0, g)):
        _assert_equal(a.cpu()[number], b.cpu()[number])
    # Hardsigmoid: the activation and the 1/6 are torch ops; its bits are
    # in NCHW order (a copy of a channels-last x and g)
    extra = 0 if name != 'hardsigmoid' else 1 + channels_last
    assert forward.triton == ['_pack'], forward.triton
    assert len(forward.ops) == extra, forward.ops
    assert backward.triton == ['_apply'], backward.triton
    assert len(backward.ops) == extra, backward.ops


def test_switched_off_runs_the_pytorch_path():
    x0, g = _values((2, 3, 4, 5), seed=5), _values((2, 3, 4, 5), seed=6)
    lean = _lean(nn.ReLU())
    with triton_enabled(False):
        forward, backward = _forward_backward(lean, x0.to(DEVICE),
                                              g.to(DEVICE), count=True)
    assert forward.triton == backward.triton == []
    # the plain module on the same device (CUDA's ReLU maps -0 to +0)
    want = _forward_backward(nn.ReLU(), x0.to(DEVICE), g.to(DEVICE))
    for a, b in zip(forward.result, want):
        _assert_equal(a.cpu(), b.cpu())


def _assert_equal(a, b):
    """Equal bit for bit but for NaN payloads; the sign of zeros too on the
    CPU. (On CUDA, torch's own ReLU maps -0 to +0 where its CPU kernel
    keeps -0; the kernels keep it: zeros compared by value there.)"""
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.isnan(), b.isnan())
    assert torch.equal(a.nan_to_num(), b.nan_to_num())
    if DEVICE == 'cpu':
        assert torch.equal(a.signbit() & ~a.isnan(),
                           b.signbit() & ~b.isnan())


def _lean(module):
    """A lean copy of ``module``."""
    module = copy.deepcopy(module)
    assert make_lean(module) is not None
    return module


class _Counted:
    """What :func:`_count` saw: the Triton kernels launched (``triton``),
    the torch operators that run a kernel (``ops``) and ``fn``'s result."""

    def __init__(self):
        self.triton, self.ops, self.result = [], [], None


class _Launcher:
    """``kernel[grid](...)`` recorded under ``name``; the torch operators
    Triton runs inside (the interpreter's copies) are not counted. Works on
    a GPU too, where no interpreter runs the launch."""

    def __init__(self, kernel, name, counter, launched):
        self.kernel, self.name = kernel, name
        self.counter, self.launched = counter, launched

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launched.append(self.name)
            self.counter._inside_triton += 1
            try:
                return self.kernel[grid](*args, **kwargs)
            finally:
                self.counter._inside_triton -= 1
        return launch


def _count(fn, kernels=triton_bit_mask_kernels, names=('_pack', '_apply')):
    """``fn()``'s launches: ``kernels``' Triton kernels ``names`` and the
    torch ops that run a kernel, as :class:`LaunchCounter` counts them
    (``.result``: what ``fn`` returned)."""
    counter, counted = LaunchCounter(), _Counted()
    mp = pytest.MonkeyPatch()
    for name in names:
        mp.setattr(kernels, name, _Launcher(getattr(kernels, name), name,
                                            counter, counted.triton))
    try:
        with counter:
            counted.result = fn()
    finally:
        mp.undo()
    # 'aten.sum.dim_IntList' -> 'sum': the operators' names, as the cases
    # list them
    counted.ops = [x.op.split('.')[1] for x in counter.result.launches]
    return counted


def _forward_backward(module, x0, g, count=False, counted=()):
    """Output and input gradient of ``module`` on a non-leaf copy of
    ``x0`` (a clone, whose backward launches nothing); with ``count``, the
    launches of the forward and the backward (``(forward, backward)``
    counters of :func:`_count` with ``counted``, the output and the
    gradient as the forward's ``.result``)."""
    x = x0.clone().requires_grad_(True)
    h = x.clone()
    if not count:
        y = module(h)
        y.backward(g)
        return y.detach(), x.grad
    forward = _count(lambda: module(h), *counted)
    backward = _count(lambda: torch.autograd.grad(forward.result, x, g),
                      *counted)
    forward.result = (forward.result.detach(), backward.result[0])
    return forward, backward


@pytest.mark.parametrize('dtype', [torch.float32, torch.float16])
def test_drop_path_backward_equals_the_pytorch_path(dtype):
    """DropPath's backward ``g.div(p) * keep`` from one bit per sample:
    one launch, the PyTorch path's numbers bit for bit (inf / NaN in
    ``g`` included), the same draws in the forward."""
    x0 = _values((16, 3, 2, 5), dtype, seed=7).to(DEVICE)
    g = _values((16, 3, 2, 5), dtype, seed=8).to(DEVICE)

    def drop_path(x):
        torch.manual_seed(0)  # the device's own generator draws the mask
        return BitMaskDropPathFunction.apply(x, 0.5)

    with pytorch_path():
        want = _forward_backward(drop_path, x0, g)
    kept = want[1].nan_to_num().flatten(1).abs().sum(1) > 0
    assert kept.any() and not kept.all()  # both kinds of sample
    forward, backward = _forward_backward(
        drop_path, x0, g, count=True,
        counted=(triton_bit_mask_kernels, ('_pack', '_apply_per_sample')))
    for a, b in zip(forward.result, want):
        _assert_equal(a.cpu(), b.cpu())
    assert forward.triton == ['_pack']
    assert backward.triton == ['_apply_per_sample'] and backward.ops == []
