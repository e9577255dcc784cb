"""The CUDA kernels one training step launches, recorded on a GPU.

:mod:`.launches` counts, on a CPU, the operators the CUDA path would
launch. This module measures the same thing where a GPU is present:
``torch.profiler`` records every kernel the device runs during one step,
after uncounted warm-up steps (first calls create optimizer state, cuDNN
plans and compiled Triton kernels), and each kernel is assigned to the
phase (forward, backward, optimizer) whose host range contains its start:
every phase ends with a synchronisation, so no kernel of one phase starts
inside the next one's range.

The recorded counts include what the CPU count leaves out by definition
(cuDNN's and cuBLAS's helper kernels, memory sets of fresh allocations),
so the two agree in their ratios more than in their totals; the GPU check
reports both (docs/benchmarks/README.md#gpu).
"""
from collections import Counter
from typing import Callable, Dict, List, Tuple

import torch
from torch.autograd.profiler import record_function

from .launches import PHASES

__all__ = ['record_step_kernels']

_RANGE = 'mmseg_gf.phase.'


class _PhaseRanges:
    """``phase(name)`` ends the current phase (after a synchronisation)
    and opens ``name``'s host range."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.current = None

    def __call__(self, name: str) -> None:
        self.close()
        self.current = record_function(_RANGE + name)
        self.current.__enter__()

    def close(self) -> None:
        if self.current is not None:
            torch.cuda.synchronize(self.device)
            self.current.__exit__(None, None, None)
            self.current = None


def _phase_of(start_us: float, ranges: List[Tuple[str, float, float]]):
    for name, begin, end in ranges:
        if begin <= start_us <= end:
            return name
    return None


def record_step_kernels(step: Callable[[Callable[[str], None]], None],
                        device, warmup: int = 2) -> Dict:
    """Kernels of one ``step(phase)`` on a CUDA ``device``.

    ``step`` runs one training step and calls ``phase('backward')`` and
    ``phase('optimizer')`` as it reaches them (as for
    :func:`~.launches.count_step`). Returns per phase (and ``'step'``)
    ``launches`` (kernels recorded) and ``by_name`` (kernels per name, the
    most frequent first), ``host_us`` (the phase's wall time on the host,
    its closing synchronisation included), ``gpu_us`` (the summed durations
    of its kernels: far below ``host_us`` when the host's launching, not
    the device, bounds the phase) and ``time_by_name`` (microseconds per
    kernel name, the longest first), plus ``unassigned``: kernels that
    started outside every phase's range (none when the step synchronises
    as asked).
    """
    from torch.profiler import ProfilerActivity, profile
    device = torch.device(device)
    for _ in range(warmup):
        step(lambda name: None)
    torch.cuda.synchronize(device)
    phases = _PhaseRanges(device)
    with profile(activities=[ProfilerActivity.CPU,
                             ProfilerActivity.CUDA]) as prof:
        phases('forward')
        step(phases)
        phases.close()
    events = prof.events()
    ranges = [(e.name[len(_RANGE):], e.time_range.start, e.time_range.end)
              for e in events if e.name.startswith(_RANGE)
              and e.device_type == torch.autograd.DeviceType.CPU]
    names: Dict[str, Counter] = {phase: Counter() for phase in PHASES}
    times: Dict[str, Counter] = {phase: Counter() for phase in PHASES}
    host = Counter({name: end - begin for name, begin, end in ranges})
    unassigned = 0
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA or \
                e.name.startswith(_RANGE):
            continue
        phase = _phase_of(e.time_range.start, ranges)
        if phase in names:
            names[phase][e.name] += 1
            times[phase][e.name] += e.time_range.elapsed_us()
        else:
            unassigned += 1
    def phase_record(count: Counter, time: Counter, host_us: float):
        return dict(launches=sum(count.values()),
                    by_name=dict(count.most_common()), host_us=host_us,
                    gpu_us=sum(time.values()),
                    time_by_name=dict(time.most_common()))

    out = {phase: phase_record(names[phase], times[phase], host[phase])
           for phase in PHASES}
    out['step'] = phase_record(sum(names.values(), Counter()),
                               sum(times.values(), Counter()),
                               sum(host[p] for p in PHASES))
    out['unassigned'] = unassigned
    return out
