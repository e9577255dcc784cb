"""``--amp`` without a GPU: CPUAmpOptimWrapper autocasts the forward to
bfloat16; enable_amp picks it when CUDA is absent."""
import mmap

import pytest
import torch
from mmengine.config import Config
from mmseg.registry import OPTIM_WRAPPERS

from mmseg_gf.engine import cpu_amp
from mmseg_gf.engine.cpu_amp import (CPUAmpOptimWrapper, cpu_flags,
                                     enable_amp, native_cpu_dtype)


def test_wrapper_autocasts_forward_to_bfloat16():
    model = torch.nn.Linear(4, 3)
    wrapper = OPTIM_WRAPPERS.build(
        dict(type='CPUAmpOptimWrapper',
             optimizer=torch.optim.SGD(model.parameters(), lr=0.1)))
    assert isinstance(wrapper, CPUAmpOptimWrapper)
    x = torch.randn(2, 4)
    with wrapper.optim_context(model):
        y = model(x)
    assert y.dtype == torch.bfloat16
    assert model(x).dtype == torch.float32
    before = model.weight.detach().clone()
    wrapper.update_params(y.float().square().mean())
    assert not torch.equal(before, model.weight)
    with pytest.raises(ValueError, match="dtype must be one of"):
        CPUAmpOptimWrapper(dtype='float64', optimizer=wrapper.optimizer)


def _flags(monkeypatch, flags):
    monkeypatch.setattr(cpu_amp, 'cpu_flags', lambda: flags)


def _build(dtype='bfloat16'):
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    return CPUAmpOptimWrapper(dtype=dtype, optimizer=optimizer)


def test_emulated_bfloat16_is_warned_with_the_slowdown(monkeypatch,
                                                       log_records):
    _flags(monkeypatch, frozenset({'avx2', 'avx512f', 'fma'}))
    assert native_cpu_dtype('bfloat16') is False
    _build()
    warned = [m for m in log_records if 'no native bfloat16' in m]
    assert len(warned) == 1, log_records
    assert '5-10x slower' in warned[0] and 'without --amp' in warned[0]
    assert 'avx512_bf16' in warned[0]


@pytest.mark.parametrize('flags', [{'avx512_bf16'}, {'amx_bf16', 'avx2'},
                                   {'bf16', 'asimd'}, None])
def test_native_or_unknown_bfloat16_is_not_warned(monkeypatch, log_records,
                                                  flags):
    _flags(monkeypatch, None if flags is None else frozenset(flags))
    _build()
    assert not [m for m in log_records if 'no native' in m], log_records


def test_float16_reads_its_own_flags(monkeypatch, log_records):
    _flags(monkeypatch, frozenset({'avx512_bf16'}))
    assert native_cpu_dtype('float16') is False
    _build('float16')
    assert [m for m in log_records if 'no native float16' in m]


def test_cpu_flags_reads_x86_and_arm_lines(tmp_path):
    x86 = tmp_path / 'x86'
    x86.write_text('processor\t: 0\nflags\t\t: fpu AVX512_BF16 sse\n\n'
                   'processor\t: 1\nflags\t\t: fpu avx512_bf16 sse\n')
    arm = tmp_path / 'arm'
    arm.write_text('Features\t: fp asimd bf16 i8mm\n')
    assert cpu_flags(str(x86)) == {'fpu', 'avx512_bf16', 'sse'}
    assert 'bf16' in cpu_flags(str(arm))
    assert cpu_flags(str(tmp_path / 'none')) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason='CUDA machine')
def test_enable_amp_without_cuda():
    cfg = Config(dict(optim_wrapper=dict(type='OptimWrapper',
                                         optimizer=dict(type='SGD'))))
    enable_amp(cfg)
    assert cfg.optim_wrapper.type == 'CPUAmpOptimWrapper'
    enable_amp(cfg)  # already on: unchanged, with a warning
    assert cfg.optim_wrapper.type == 'CPUAmpOptimWrapper'
    bad = Config(dict(optim_wrapper=dict(type='ApexOptimWrapper')))
    with pytest.raises(ValueError, match='only supported when'):
        enable_amp(bad)


def test_precision_summary_names_the_autocast_dtype():
    from mmengine.optim import OptimWrapper
    from mmseg_gf.engine.train_log import precision_summary
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    amp = CPUAmpOptimWrapper(optimizer=optimizer)
    assert precision_summary(amp) == (
        'training precision: AMP on: cpu autocast to bfloat16 '
        '(CPUAmpOptimWrapper)')
    assert precision_summary(OptimWrapper(optimizer=optimizer)) == (
        "training precision: AMP off (parameters' dtype, OptimWrapper)")


def test_peak_resident_memory_covers_the_interval_since_reset():
    """64 MiB of fresh pages written after a reset raise the peak by about
    as much; after they are unmapped and the peak reset, the peak falls
    again. The pages are an anonymous mapping of their own, not the
    allocator's: freed heap memory that malloc keeps resident (another
    test's ``reuse_cpu_memory``) would otherwise be reused without raising
    the peak."""
    from mmseg_gf.engine.train_log import PeakResidentMemory
    meter = PeakResidentMemory()
    if not meter.reset():
        pytest.skip('no resettable VmHWM here')
    size, page = 64 << 20, mmap.PAGESIZE
    before = meter.peak_mib()
    block = mmap.mmap(-1, size)
    for offset in range(0, size, page):  # touch every page: resident
        block[offset] = 1
    during = meter.peak_mib()
    block.close()
    meter.reset()
    after = meter.peak_mib()
    assert during - before > 48, (before, during)
    assert after < during - 48, (during, after)
