"""mmseg_gf.engine.cpu_memory: freed CPU memory kept in malloc's heap, so a
tensor as large as a step's gradients is made without page faults; the hook
applies it to CPU training within each step (``reuse_cpu_memory='step'``,
the default, given back after the step) or for the whole run (``'run'``)."""
import subprocess
import sys
from types import SimpleNamespace

import pytest
from mmengine.config import Config
from mmengine.logging import MMLogger

from mmseg_gf.engine import GradFilterHook
from mmseg_gf.engine.cpu_memory import (StepMemoryReuse, cpu_memory_kept,
                                        keep_freed_cpu_memory, reuse_mode,
                                        supported)
from tests._engine_fixtures import build_model

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


# Within a StepMemoryReuse block: page faults of 16 successive 64 MiB
# tensors, then the resident MiB inside the block and after it ended.
_STEP = '''
import re, resource, torch
from mmseg_gf.engine.cpu_memory import StepMemoryReuse, cpu_memory_kept
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def resident():
    status = open('/proc/self/status').read()
    return int(re.search(r'VmRSS:\\s+(\\d+)', status).group(1)) // 1024
counts = []
with StepMemoryReuse():
    assert cpu_memory_kept()
    for _ in range(16):
        before = faults()
        t = torch.ones(16 * 2**20)
        del t
        counts.append(faults() - before)
    inside = resident()
assert not cpu_memory_kept()
print([counts, inside, resident()])
'''


@needs_glibc
def test_step_reuse_gives_the_memory_back_at_its_end():
    out = subprocess.run([sys.executable, '-c', _STEP], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    counts, inside, after = eval(out.stdout.strip().splitlines()[-1])
    # the first tensor faults its pages in; the others reuse them
    assert counts[0] >= PAGES and all(n < PAGES // 100
                                      for n in counts[-8:]), counts
    # the freed 64 MiB was resident inside the block, given back after it
    assert inside - after >= 48, (inside, after)


def _runner():
    return SimpleNamespace(model=build_model('fcn_r18'),
                           cfg=Config(dict(crop_size=(64, 64))),
                           logger=MMLogger.get_current_instance())


@needs_glibc
def test_hook_keeps_freed_memory_as_told():
    was = cpu_memory_kept()
    try:
        keep_freed_cpu_memory(False)
        # the default: within each step, from before_train_iter to
        # after_train_iter
        hook = GradFilterHook(num_layers=2, log_table=False)
        runner = _runner()
        hook.before_train(runner)
        assert not cpu_memory_kept()
        hook.before_train_iter(runner, 0)
        assert cpu_memory_kept()
        hook.after_train_iter(runner, 0)
        assert not cpu_memory_kept()
        GradFilterHook(num_layers=2, reuse_cpu_memory='off',
                       log_table=False).before_train(_runner())
        assert not cpu_memory_kept()
        hook = GradFilterHook(num_layers=2, reuse_cpu_memory='run',
                              log_table=False)
        runner = _runner()
        hook.before_train(runner)
        assert cpu_memory_kept()
        hook.after_train_iter(runner, 0)
        assert cpu_memory_kept()  # for the whole run
    finally:
        keep_freed_cpu_memory(was)


def test_step_reuse_leaves_a_run_wide_setting_alone():
    was = cpu_memory_kept()
    try:
        if not keep_freed_cpu_memory(True):
            pytest.skip('the C library has no glibc mallopt')
        with StepMemoryReuse():
            pass
        assert cpu_memory_kept()
    finally:
        keep_freed_cpu_memory(was)


def test_setting_names_its_allowed_values():
    assert [reuse_mode(v) for v in ('step', 'run', 'off', True, False)] == \
        ['step', 'run', 'off', 'run', 'off']
    with pytest.raises(ValueError, match=r"reuse_cpu_memory must be one of "
                       r"\['step', 'run', 'off'\]"):
        GradFilterHook(num_layers=2, reuse_cpu_memory='yes')
