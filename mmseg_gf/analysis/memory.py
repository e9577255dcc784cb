"""Measured memory: what autograd really keeps, and a step's peak.

The analytic counts live in :mod:`mmseg_gf.analysis.cost`; these functions
measure the same quantities so the two can be checked against each other.
"""

import os
import resource
from typing import Callable

import torch
from torch import nn


def saved_tensor_bytes(forward: Callable[[], object]) -> int:
    """Bytes of the tensors autograd saves for backward while ``forward()``
    runs, counting each storage once and leaving out Parameters (they are
    alive anyway). Returns the total in bytes.
    """
    storages = {}

    def pack(t: torch.Tensor):
        if not isinstance(t, nn.Parameter):
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(storages.values())


def peak_step_bytes(step: Callable[[], object],
                    device: torch.device) -> int:
    """Peak memory of one training step above what was allocated before it.

    CUDA: ``max_memory_allocated``. CPU: the growth of the process's peak
    resident set (``ru_maxrss``), which only rises: run each variant in a
    fresh process (``tools/benchmark_model.py`` does) for comparable numbers.
    """
    if device.type == 'cuda':
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    before = _max_rss_bytes()
    step()
    return _max_rss_bytes() - before


def _max_rss_bytes() -> int:
    # ru_maxrss is in kilobytes on Linux (bytes on macOS).
    scale = 1 if os.uname().sysname == 'Darwin' else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
