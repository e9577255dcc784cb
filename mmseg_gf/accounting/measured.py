"""Measured memory: what autograd really keeps, and a step's peak.

The analytic counts (:mod:`.kept`, :mod:`.profile`) are checked against
these measurements. Saved bytes are counted per storage (a view of a kept
tensor costs nothing more). How the CPU peak is read from the profiler:
docs/cost.md, "How the CPU peak is read from the profiler"."""

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
    """Bytes autograd saves for backward while ``forward()`` runs, each
    storage once, Parameters left out (alive anyway)."""
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

    A saved tensor goes to the innermost of ``modules`` running; each storage
    counts once per module and once in the total.

    Args:
        forward: runs the forward pass (with autograd recording).
        modules: name -> module whose saved tensors are attributed.
        exclude: tensors whose storages are not counted (e.g. Parameters).

    Returns:
        ``({name: bytes}, total_bytes)``; the total covers everything saved
        during ``forward()``, inside the listed modules or not."""
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

    CUDA: ``torch.cuda.max_memory_allocated`` above what was allocated before.
    CPU: the peak of the live bytes of the tensors the step made, at operator
    granularity, from the profiler's events (:func:`_memory_changes`). Unlike
    ``ru_maxrss`` it is exact to the tensor and unaffected by the allocator's
    cache and earlier peaks, so variants compare in one process."""
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
    """``(time ns, bytes)`` of the CPU allocations (+) and frees (-) of blocks
    the run allocated, and the start times of the ranges named ``marker``.
    Netting and placement rules: docs/cost.md, "How the CPU peak is read from
    the profiler"."""
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
    """Peak live tensor bytes of ``run()`` between consecutive :func:`mark` s.

    Args:
        collect: run the garbage collector first (skip for many short runs).

    Returns:
        list[int]: one peak per interval: before the first marker, between
        markers, after the last one (``marker=None``: the whole run)."""
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
