"""``--amp`` without a GPU: CPUAmpOptimWrapper autocasts the forward to
bfloat16; enable_amp picks it when CUDA is absent."""
import mmap

import pytest
import torch
from mmengine.config import Config
from mmseg.registry import OPTIM_WRAPPERS

from mmseg_gf.engine.cpu_amp import CPUAmpOptimWrapper, enable_amp


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
