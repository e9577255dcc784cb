"""mmseg_gf.engine.cpu_memory: freed CPU memory kept in malloc's heap, so a
tensor as large as a step's gradients is made without page faults; the hook
applies it to CPU training with ``reuse_cpu_memory=True``."""
import subprocess
import sys
from types import SimpleNamespace

import pytest
from mmengine.config import Config
from mmengine.logging import MMLogger

from mmseg_gf.engine import GradFilterHook
from mmseg_gf.engine.cpu_memory import (cpu_memory_kept,
                                        keep_freed_cpu_memory, supported)
from tests.helpers.engine_fixtures import build_model

# Minor page faults of making (and filling) a 64 MiB tensor 16 times after a
# first one, in a fresh process: argv[1] 'keep', 'release' or 'default'.
_FAULTS = '''
import resource, sys, torch
from mmseg_gf.engine.cpu_memory import keep_freed_cpu_memory
if sys.argv[1] != 'default':
    assert keep_freed_cpu_memory(sys.argv[1] == 'keep')
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
t = torch.ones(16 * 2**20); del t
counts = []
for _ in range(16):
    before = faults()
    t = torch.ones(16 * 2**20)
    del t
    counts.append(faults() - before)
print(counts)
'''
PAGES = 64 * 2**20 // 4096


def _faults(mode):
    out = subprocess.run([sys.executable, '-c', _FAULTS, mode],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return eval(out.stdout.strip().splitlines()[-1])


needs_glibc = pytest.mark.skipif(not supported(),
                                 reason='the C library has no glibc mallopt')


@needs_glibc
def test_kept_memory_is_reused_without_page_faults():
    # glibc's default: each 64 MiB tensor is a fresh mmap, every page
    # faulted in again
    counts = _faults('default')
    assert all(n >= PAGES for n in counts), counts
    # kept: the heap grows while small allocations split the freed block
    # (a few steps), then the same pages serve every next tensor
    counts = _faults('keep')
    assert all(n < PAGES // 100 for n in counts[-8:]), counts
    # given back again
    counts = _faults('release')
    assert all(n >= PAGES for n in counts), counts


@needs_glibc
def test_hook_keeps_freed_memory_when_told_to():
    def runner():
        return SimpleNamespace(model=build_model('fcn_r18'),
                               cfg=Config(dict(crop_size=(64, 64))),
                               logger=MMLogger.get_current_instance())

    was = cpu_memory_kept()
    try:
        keep_freed_cpu_memory(False)
        GradFilterHook(num_layers=2, log_table=False).before_train(runner())
        assert not cpu_memory_kept()  # the default
        GradFilterHook(num_layers=2, reuse_cpu_memory=True,
                       log_table=False).before_train(runner())
        assert cpu_memory_kept()
    finally:
        keep_freed_cpu_memory(was)


def test_setting_must_be_a_flag():
    with pytest.raises(ValueError, match='reuse_cpu_memory must be True or '
                       'False'):
        GradFilterHook(num_layers=2, reuse_cpu_memory='yes')
