"""Measured memory: what autograd really keeps, and a step's peak.

The analytic counts (:mod:`.kept`, :mod:`.profile`) predict these
quantities; the functions here measure them, so that the two are checked
against each other, and the budget's peak model reads its forward's live
bytes from :func:`live_bytes_by_interval`. Saved bytes are counted per
storage everywhere (a view of a kept tensor costs nothing more).
"""

import gc
import re
from typing import (Callable, Dict, Iterable, Iterator, List, Mapping,
                    Optional, Tuple)

import torch
from torch import nn
from torch._C._profiler import _EventType
from torch.autograd import profiler

from ..ops.backend import output_pool
from ..patching import Hooks


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

    hooks = Hooks()
    for name, module in modules.items():
        hooks.add(module.register_forward_pre_hook(enter(name)))
        hooks.add(module.register_forward_hook(leave))
    with hooks.removed_after(), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return ({name: sum(v.values())
             for name, v in per_module.items()}, sum(everything.values()))


def profiled_peak_bytes(step: Callable[[], object],
                        device: Optional[torch.device] = None) -> int:
    """Peak memory of what ``step()`` allocates.

    CUDA: ``torch.cuda.max_memory_allocated`` above what was allocated
    before the step.
    CPU: the running sum of the allocations torch's profiler records
    (``profile_memory=True``) and of the frees of those blocks, in time
    order, allocations at the start of the op making them and frees at its
    end (those between operators, in a custom Function's forward or an
    autograd node's backward, at their own time), i.e. the peak of the live
    bytes of the tensors the step made, at operator granularity (a
    temporary allocated and freed inside one op is not seen; freeing memory
    allocated before the step lowers nothing: :func:`_memory_changes`).
    Unlike ``ru_maxrss`` it is exact to the tensor, unaffected by the
    allocator's caching and earlier peaks of the process, so variants can be
    compared in one process. The native kernels' output recycling is off
    during the step, so that every output is counted.
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


def _walk(nodes) -> Iterator:
    """Every node of the profiler's event tree, depth first, in order."""
    stack = list(reversed(nodes))
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(node.children))


def _memory_changes(prof, marker: Optional[str]
                    ) -> Tuple[List[Tuple[int, int]], List[int]]:
    """``(time ns, bytes)`` of the CPU allocations (+) and frees (-) of
    blocks the run allocated, and the start times of the ranges named
    ``marker`` (none for None).

    An operator call's own changes (``aten::softmax``, not those of the
    operators it calls) are netted and placed at its start if the net is
    positive, at its end if negative: a temporary allocated and freed
    inside one operator is not seen. Changes directly inside ranges that
    are no operator (a custom Function's forward, an autograd node's
    backward, which run Python between their operators) or outside any
    range stay at their own time, e.g. the tensors of a loss computed and
    differentiated inside a forward each live as long as they do.

    A free counts only when the run allocated the block (matched by
    address). The profiler reports no free of a block allocated while no
    profiler ran, but does report one of a block that an earlier profiling
    session saw allocated (a tensor an earlier measurement left alive):
    counted, such frees would lower the running sum by amounts that depend
    on the process's history, down to a peak of 0 for a small step.
    """
    allocated = set()
    own: Dict[int, list] = {}  # operator node id -> [node, net bytes]
    changes: List[Tuple[int, int]] = []
    cuts: List[int] = []
    for node in _walk(prof.kineto_results.experimental_event_tree()):
        kind, fields = node.typed
        if kind != _EventType.Allocation:
            if marker is not None and node.name == marker:
                cuts.append(node.start_time_ns)
            continue
        if fields.device.type != 'cpu':
            continue
        size, ptr = fields.alloc_size, fields.ptr
        if size > 0:
            allocated.add(ptr)
        elif ptr in allocated:
            allocated.discard(ptr)
        else:
            continue  # a block allocated before the run
        parent = node.parent
        if parent is not None and _OPERATOR_NAME.match(parent.name):
            own.setdefault(id(parent), [parent, 0])[1] += size
        else:
            changes.append((node.start_time_ns, size))
    for op, delta in own.values():
        if delta:
            changes.append((op.start_time_ns if delta > 0 else
                            op.end_time_ns, delta))
    return changes, sorted(cuts)


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
    # A collection during the run would free the run's own garbage at the
    # collector's whim: collect what is owed first, and keep the collector
    # off meanwhile.
    if collect:
        gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    # Recycled outputs were allocated in an earlier step: the profiler would
    # not see them. Live tensor bytes are the same either way.
    try:
        with output_pool.recycling_off(), profiler.profile(
                profile_memory=True) as prof:
            run()
    finally:
        if was_enabled:
            gc.enable()
    changes, cuts = _memory_changes(prof, marker)
    changes.sort(key=lambda c: (c[0], -c[1]))
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
