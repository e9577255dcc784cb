"""mmseg_gf.accounting.quiet: torch's profiler lines (written from C++ to
file descriptor 2) dropped for a block, every other line passed on."""
import os

import torch
from torch.profiler import ProfilerActivity, profile

from mmseg_gf.accounting.quiet import PROFILER_NOISE, quiet_profiler


def _profiled_step():
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
        torch.ones(8).sum()


def test_profiler_lines_dropped_other_lines_kept(capfd):
    _profiled_step()
    loud = capfd.readouterr().err
    assert PROFILER_NOISE.search(loud.encode()), loud  # the lines exist
    with quiet_profiler():
        _profiled_step()
        os.write(2, b'a line from C++\n')
        _profiled_step()
    assert capfd.readouterr().err == 'a line from C++\n'
    with quiet_profiler(enabled=False):
        _profiled_step()
    assert PROFILER_NOISE.search(capfd.readouterr().err.encode())
