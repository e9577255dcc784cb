"""Measured memory: what autograd really keeps, and a step's peak.

The analytic counts (:mod:`.kept`, :mod:`.profile`) predict these
quantities; the functions here measure them, so that the two are checked
against each other, and the budget's peak model reads its forward's live
bytes from :func:`live_bytes_by_interval`. Saved bytes are counted per
storage everywhere (a view of a kept tensor costs nothing more).
"""

import bisect
import gc
import re
from typing import (Callable, Dict, Iterable, List, Mapping, Optional,
                    Tuple)

import torch
from torch import nn
from torch.autograd import DeviceType, profiler

from ..ops import native


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


def _cuda_peak_bytes(step: Callable[[], object],
                     device: torch.device) -> int:
    """``max_memory_allocated`` of ``step()`` above what was allocated
    before it."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def saved_bytes_by_module(
        forward: Callable[[], object],
        modules: Mapping[str, nn.Module],
        exclude: Iterable[torch.Tensor] = ()) -> Tuple[Dict[str, int], int]:
    """Bytes autograd saves while ``forward()`` runs, per module and in all.

    A tensor packed for backward while one of ``modules`` is running (its
    ``forward``, hooks included) is attributed to that module (to the
    innermost one if they nest). Each storage is counted once per module and
    once in the total; storages of ``exclude`` (e.g. the model's
    Parameters, alive anyway) are left out.

    Args:
        forward: runs the forward pass (with autograd recording).
        modules: name -> module whose saved tensors are attributed.
        exclude: tensors whose storages are not counted.

    Returns:
        ``({name: bytes}, total_bytes)``; the total covers everything saved
        during ``forward()``, inside the listed modules or not.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    per_module: Dict[str, Dict[int, int]] = {name: {} for name in modules}
    everything: Dict[int, int] = {}
    stack = []

    def pack(t: torch.Tensor):
        if isinstance(t, nn.Parameter):
            return t
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in skip:
            return t
        everything[ptr] = storage.nbytes()
        if stack:
            per_module[stack[-1]][ptr] = storage.nbytes()
        return t

    def enter(name):

        def hook(module, args):
            stack.append(name)

        return hook

    def leave(module, args, output):
        stack.pop()

    handles = []
    for name, module in modules.items():
        handles.append(module.register_forward_pre_hook(enter(name)))
        handles.append(module.register_forward_hook(leave))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward()
    finally:
        for handle in handles:
            handle.remove()
    return ({name: sum(v.values())
             for name, v in per_module.items()}, sum(everything.values()))


def profiled_peak_bytes(step: Callable[[], object],
                        device: Optional[torch.device] = None) -> int:
    """Peak memory of ``step()`` above what was allocated before it.

    CUDA: ``torch.cuda.max_memory_allocated``.
    CPU: the running sum of the allocations and frees torch's profiler
    records (``profile_memory=True``) in time order, allocations at the start
    of the op making them and frees at its end (those between operators, in
    a custom Function's forward or an autograd node's backward, at their
    own time), i.e. the peak of live tensor bytes at operator granularity
    (a temporary allocated and freed inside one op is not seen). Unlike ``ru_maxrss`` it is exact to the tensor,
    unaffected by the allocator's caching and earlier peaks of the process,
    so variants can be compared in one process. The native kernels' output
    recycling is off during the step, so that every output is counted.
    """
    device = torch.device('cpu') if device is None else torch.device(device)
    if device.type == 'cuda':
        return _cuda_peak_bytes(step, device)
    return max(live_bytes_by_interval(step, marker=None))


#: Name of the profiler ranges :func:`mark` records.
MARKER = 'mmseg_gf::mark'


def mark() -> None:
    """Record a point in time for :func:`live_bytes_by_interval`."""
    with torch.autograd.profiler.record_function(MARKER):
        pass


_OPERATOR_NAME = re.compile(r'^\w+::[\w.]+$')


def _operator_spans(events) -> Tuple[List[float], List[float]]:
    """Start and end times (us) of the outermost operator calls
    (``aten::softmax``, not an autograd node's or a custom Function's
    range, which run Python between their operators), sorted."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if _OPERATOR_NAME.match(e.name))
    starts: List[float] = []
    ends: List[float] = []
    for start, end in spans:
        if ends and start < ends[-1]:
            continue  # inside the previous outermost call
        starts.append(start)
        ends.append(end)
    return starts, ends


def _memory_changes(prof) -> List[Tuple[float, int]]:
    """``(time us, bytes)`` of the CPU allocations (+) and frees (-): an
    operator call's own (``self_cpu_memory_usage``, the net of what it
    allocates and frees outside the operators it calls) at its start if
    positive, at its end if negative; anything else at its own time.

    Not every event's ``self_cpu_memory_usage``: a range with children
    that is no operator (a custom Function's forward, an autograd node's
    backward) has what it frees between its operators summed into one
    change at its end, e.g. every tensor of a loss computed and
    differentiated inside a forward, as if all lived until it returned.
    """
    starts, ends = _operator_spans(prof.function_events)
    changes = []
    for event in prof.function_events:
        delta = event.self_cpu_memory_usage
        if delta and _OPERATOR_NAME.match(event.name):
            changes.append((event.time_range.start if delta > 0 else
                            event.time_range.end, delta))
    result = prof.kineto_results
    for record in result.events():
        if record.name() != '[memory]' or \
                record.device_type() != DeviceType.CPU:
            continue
        time = (record.start_ns() - result.trace_start_ns()) / 1000
        i = bisect.bisect_right(starts, time) - 1
        if i < 0 or time > ends[i]:  # outside every operator call
            changes.append((time, record.nbytes()))
    return changes


def live_bytes_by_interval(run: Callable[[], object],
                           marker: Optional[str] = MARKER,
                           collect: bool = True) -> list:
    """Peak live tensor bytes of ``run()`` between consecutive markers.

    The CPU profiler's allocation and free events are summed in time order
    (allocations at the start of the operator making them, frees at its
    end, as in :func:`profiled_peak_bytes`; those outside any operator at
    their own time: :func:`_memory_changes`), starting from 0 at the call;
    ``run`` calls :func:`mark` to cut the time line into intervals.

    Args:
        collect: run the garbage collector first (~0.1-0.2 s with mmseg
            loaded). Garbage is never collected *during* the run either
            way; skip this for many short runs on a heap made of nothing
            but models and small objects.

    Returns:
        list[int]: one peak per interval: before the first marker, between
        markers, after the last one (``marker=None``: the whole run, one
        value).
    """
    # Garbage of earlier code collected during the run would count as frees
    # (of blocks an earlier profiling session saw allocated), lowering the
    # running sum: collect it first, and keep the collector off meanwhile.
    if collect:
        gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    # Recycled outputs were allocated in an earlier step: the profiler would
    # not see them. Live tensor bytes are the same either way.
    try:
        with native.recycling_off(), profiler.profile(
                profile_memory=True) as prof:
            run()
    finally:
        if was_enabled:
            gc.enable()
    changes = _memory_changes(prof)
    cuts = [e.time_range.start for e in prof.function_events
            if marker is not None and e.name == marker]
    changes.sort(key=lambda c: (c[0], -c[1]))
    cuts.sort()
    peaks = [0] * (len(cuts) + 1)
    live = interval = 0
    for time, delta in changes:
        while interval < len(cuts) and cuts[interval] <= time:
            interval += 1
            peaks[interval] = live
        live += delta
        peaks[interval] = max(peaks[interval], live)
    for later in range(interval + 1, len(peaks)):
        peaks[later] = live
    return peaks
