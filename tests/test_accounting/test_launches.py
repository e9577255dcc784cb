"""What :mod:`mmseg_gf.accounting.launches` counts as a launch, the bytes
it gives each, the switches that put CPU tensors on CUDA's path, and the
attribution by phase and kind, on small graphs whose launches are known
operator by operator (the four models' counts: test_launch_count.py)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mmseg_gf.accounting.cuda_path import cuda_path
from mmseg_gf.accounting.launches import (KINDS, LaunchCounter, count_step,
                                          module_kind)
from mmseg_gf.models.gf_conv import GFConv2d
from mmseg_gf.models.lean import make_lean
from mmseg_gf.ops.bit_mask import masks as bit_mask
from mmseg_gf.ops.backend import availability, device_path
from mmseg_gf.ops.resized_loss import loss as resized_loss
from mmseg_gf.ops.backend import switches, triton_runtime
from mmseg_gf.ops.conv import cpu as conv_cpu

F32 = 4


def _count(fn):
    counter = LaunchCounter()
    with counter:
        fn()
    return counter.result


def test_views_allocations_and_metadata_launch_nothing():
    a = torch.randn(4, 8)
    result = _count(lambda: (a.view(8, 4), a.t(), a[1:], a.reshape(32),
                             a.detach(), torch.empty(3), a.new_empty(2),
                             torch.empty_like(a), a.shape, a.dtype))
    assert result.launches == [] and result.host_reads == {}


def test_inputs_read_once_outputs_written_once():
    """``a + a`` reads ``a`` once; an in-place op reads and writes
    ``self``; an ``out=`` argument is written, not read."""
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    out = torch.empty(4, 8)
    result = _count(lambda: (a + a, a.mul_(b), torch.add(a, b, out=out),
                             a.sum()))
    size = 32 * F32
    assert [(x.op, x.read, x.written) for x in result.launches] == [
        ('aten.add.Tensor', size, size),
        ('aten.mul_.Tensor', 2 * size, size),
        ('aten.add.out', 2 * size, size),
        ('aten.sum.default', size, F32)]
    assert result.bytes_moved() == 9 * size + F32


def test_broadcast_inputs_read_once():
    """An expanded operand (stride 0) is read once: its distinct
    elements, not the elements it stands for."""
    one = torch.ones(())
    a = torch.randn(4, 8)
    row = torch.randn(8)
    result = _count(lambda: (a * one.expand(4, 8), a + row.expand(4, 8)))
    size = 32 * F32
    assert [(x.read, x.written) for x in result.launches] == [
        (size + F32, size), (size + 8 * F32, size)]


def test_host_reads_are_counted_apart():
    a = torch.randn(5)
    result = _count(lambda: float(a.sum()))
    assert [x.op for x in result.launches] == ['aten.sum.default']
    assert result.host_reads == {'forward': 1}


def test_cuda_path_switches_and_restores(switch_override):
    switch_override(MMSEG_GF_NATIVE=True)
    t = torch.zeros(2, 3, 4, 4)
    assert device_path.host_checks(t)
    with cuda_path(triton=False):
        assert switches.value('MMSEG_GF_NATIVE') is False
        assert not availability.native_available() and not conv_cpu.usable(t)
        assert not bit_mask.native_available()
        assert not resized_loss.kernel_usable(t)
        assert not device_path.host_checks(t)
        assert not availability.triton_enabled()
    assert switches.value('MMSEG_GF_NATIVE') is True
    assert device_path.host_checks(t)


@pytest.mark.skipif(triton_runtime.INTERPRETED, reason='the interpreter is on')
def test_the_triton_path_needs_the_interpreter():
    with pytest.raises(RuntimeError, match='TRITON_INTERPRET=1'):
        with cuda_path(triton=True):
            pass


def test_dropout_runs_the_fused_kernel_of_cuda_tensors():
    """ATen fuses a CUDA tensor's dropout into one ``native_dropout``; the
    CPU's runs three kernels. In place, or with ``p = 0``, both agree."""
    x = torch.randn(64)
    on_cpu = _count(lambda: F.dropout(x, 0.5, True))
    with cuda_path(triton=False):
        fused = _count(lambda: F.dropout(x, 0.5, True))
        zero = _count(lambda: F.dropout(x, 0.0, True))
    assert len(on_cpu.launches) == 3
    assert [x.op for x in fused.launches] == ['aten.native_dropout.default']
    assert zero.launches == []


def test_the_label_check_takes_the_device_side_assertion():
    """On the CPU the label range is read on the host; as on CUDA it is
    one asynchronous assertion (no host read)."""
    label = torch.randint(0, 3, (2, 8, 8))
    on_cpu = _count(lambda: resized_loss.check_labels(label, 3, 255))
    with device_path.as_on_cuda():
        on_cuda = _count(lambda: resized_loss.check_labels(label, 3, 255))
    assert on_cpu.host_reads['forward'] >= 4  # min and max, per image
    assert on_cuda.host_reads == {}
    assert on_cuda.launches[-1].op.startswith('aten._assert_async')


class _Block(nn.Module):
    """Trained conv -> frozen eval BN -> ReLU -> trained conv."""

    def __init__(self, filtered: bool) -> None:
        super().__init__()
        self.conv1 = GFConv2d(3, 8, 3, padding=1, radius=2, enabled=filtered)
        self.bn = nn.BatchNorm2d(8).eval().requires_grad_(False)
        self.relu = nn.ReLU()
        self.conv2 = GFConv2d(8, 4, 3, padding=1, radius=2, enabled=filtered)

    def forward(self, x):
        return self.conv2(self.relu(self.bn(self.conv1(x))))


def _step_count(model: nn.Module):
    x = torch.randn(1, 3, 8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9,
                          foreach=True)

    def step(phase):
        loss = model(x).square().mean()
        phase('backward')
        loss.backward()
        phase('optimizer')
        opt.step()
        opt.zero_grad(set_to_none=True)

    return count_step(model, step, triton=False)


def test_a_plain_step_operator_by_operator():
    """The exact backward of known modules, each operator where its module
    is: one kernel per conv, norm and activation each way; the loss and
    the loss's seed gradient are no module's."""
    result = _step_count(_Block(filtered=False))
    forward = [x.op for x in result.select('forward')]
    assert forward == [
        'aten.convolution.default',
        'aten.native_batch_norm.default',
        'aten.relu.default', 'aten.convolution.default',
        'aten.pow.Tensor_Scalar', 'aten.mean.default']
    assert result.by_kind('forward') == dict(norm=1, conv=2, activation=1,
                                             other=2)
    backward = result.by_kind('backward')
    assert {k: backward[k] for k in ('activation', 'norm', 'conv')} == dict(
        activation=1, norm=1, conv=2)
    assert [x.op for x in result.select('backward', 'conv')] == \
        ['aten.convolution_backward.default'] * 2
    assert set(result.by_kind('optimizer')) == {'optimizer'}
    assert all(x.op.startswith('aten._foreach_')
               for x in result.select('optimizer'))


def test_a_lean_filtered_step_by_kind():
    """Filtered convs: their forward is the convolution plus the patch
    sums of the input (the ops not reading the weight); the lean ReLU's
    and norm's launches stay theirs in both directions; every launch has
    one kind and the phases add up."""
    model = _Block(filtered=True)
    for module in (model.bn, model.relu):
        make_lean(module)
    result = _step_count(model)
    assert [x.op for x in result.select('forward', 'filtered_conv')] == \
        ['aten.convolution.default'] * 2
    assert result.count('forward', 'patch_sums') > 0
    assert all(not x.op.startswith('aten.convolution')
               for x in result.select('forward', 'patch_sums'))
    for phase in ('forward', 'backward'):
        kinds = result.by_kind(phase)
        assert {'filtered_conv', 'norm', 'activation'} <= set(kinds)
        assert sum(kinds.values()) == result.count(phase)
    plain = _step_count(_Block(filtered=False))
    # the lean ReLU keeps bits: more launches than the plain one's 1 + 1
    assert result.count(kind='activation') > plain.count(kind='activation')
    assert result.count() == sum(result.count(p) for p in
                                 ('forward', 'backward', 'optimizer'))
    assert set(result.by_kind()) <= set(KINDS)


def test_module_kinds_are_the_same_lean_or_plain():
    relu, bn = nn.ReLU(), nn.BatchNorm2d(3).eval()
    before = module_kind(relu), module_kind(bn)
    make_lean(relu)
    make_lean(bn)
    assert (module_kind(relu), module_kind(bn)) == before == (
        'activation', 'norm')
    assert module_kind(GFConv2d(3, 3, 1, radius=2)) == 'filtered_conv'
    assert module_kind(GFConv2d(3, 3, 1, radius=2, enabled=False)) == 'conv'
    assert module_kind(nn.Sequential()) is None


def test_module_kinds_of_the_layer_kinds_families():
    """A layer of a kind's family goes to the kind's category, filtered
    or not, traced by a kind or not (a transposed or 1-D conv: the conv
    kind's family); a softmax is the attention's part, no activation."""
    attention = nn.MultiheadAttention(4, 1)
    assert [module_kind(m) for m in (
        nn.ConvTranspose2d(2, 2, 2), nn.Conv1d(2, 2, 3), nn.Linear(2, 2),
        attention, attention.out_proj, nn.Softmax(-1), nn.GELU())] == [
            'conv', 'conv', 'linear', 'attention', 'linear', None,
            'activation']


def test_a_kernel_counted_without_running_it():
    """``run_kernels=False``: the launch is recorded with its bytes, its
    outputs zeroed, and a value read on the host after it is refused (what
    follows could depend on the output it did not compute)."""
    counter = LaunchCounter(run_kernels=False)
    src, out = torch.ones(2), torch.ones(3)
    with counter:
        counter.triton_launch('_kernel', [src], [out],
                              lambda: pytest.fail('the kernel ran'))
        with pytest.raises(RuntimeError, match='run_kernels=True'):
            float(out.sum())
    (launch, _) = counter.result.launches
    assert (launch.op, launch.read, launch.written) == (
        'triton:_kernel', 2 * F32, 3 * F32)
    assert torch.equal(out, torch.zeros(3))
