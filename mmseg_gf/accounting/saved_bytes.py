"""What one training step keeps for backward: the rules' bytes per call
and the measured bytes of what no rule covers.

:func:`trace_step_saved_bytes` runs the one step tracer
(:class:`~.trace.StepTracer`) and asks each recorded call's rule
(:func:`~.kept.kept_by_call`); :class:`UnmodelledBytes` keeps the saved
tensors no rule covers and counts each storage once.
"""
from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence, Set, Tuple

import torch
from torch import nn

from ..ops.lean import kept_sources
from .batch import model_device, random_batch
from .kept import SavedItem, StepSavedBytes, kept_by_call, measured_item
from .trace import LOSS_PART, ModuleCall, SavedPack, StepTracer

__all__ = ['UnmodelledBytes', 'trace_step_saved_bytes']


@dataclass
class UnmodelledBytes:
    """The packs of a traced step that no rule of :mod:`.kept` covers.

    Covered: packs of a leaf call a rule modelled, storages a rule counts
    (:attr:`~.kept.SavedItem.storage`), and a head loss's packs that a rule
    counts exactly. Each storage counts once; one holding a Parameter or buffer
    (a Linear's weight view), or a lean loss's kept gradient w.r.t. a
    Parameter, counts the same at any batch.

    Attributes:
        resident_storages: storages of the model's Parameters and buffers.
        parameter_gradients: storages of kept gradients w.r.t. a Parameter.
    """

    packs: List[SavedPack] = field(default_factory=list)
    modelled_calls: Set[int] = field(default_factory=set)
    counted_storages: Set[int] = field(default_factory=set)
    resident_storages: Set[int] = field(default_factory=set)
    parameter_gradients: Set[int] = field(default_factory=set)
    counted_losses: Set[str] = field(default_factory=set)
    modelled_owners: Set[str] = field(default_factory=set)

    @classmethod
    def of(cls, model: nn.Module) -> 'UnmodelledBytes':
        tensors = list(model.parameters()) + list(model.buffers())
        return cls(resident_storages={t.untyped_storage().data_ptr()
                                      for t in tensors})

    def on_pack(self, pack: SavedPack) -> SavedPack:
        """Keep ``pack`` without its tensor; returns what is kept."""
        if any(isinstance(source, nn.Parameter)
               for source in kept_sources.sources_of(pack.tensor)):
            self.parameter_gradients.add(pack.ptr)
        self.packs.append(pack.slim())
        return self.packs[-1]

    def note_call(self, seq: int, path: str, items: Sequence[SavedItem],
                  modelled: bool) -> None:
        """What a rule said about call ``seq`` of module ``path``."""
        if modelled:
            self.modelled_calls.add(seq)
            # a module with children whose own code a rule counts
            self.modelled_owners.add(path)
        self.counted_storages.update(i.storage for i in items
                                     if i.storage is not None)
        # a head's loss: items of the head made at its classifier's call,
        # or the logits of a head reporting its own call
        self.counted_losses.update(
            i.path for i in items if not i.estimate and (
                i.path != path or i.category == 'logits'))

    def covered(self, pack: SavedPack) -> bool:
        if pack.leaf and pack.seq in self.modelled_calls:
            return True
        if not pack.leaf and pack.owner in self.modelled_owners \
                and not pack.kind.endswith(LOSS_PART):
            return True
        return pack.kind.endswith(LOSS_PART) and \
            pack.owner in self.counted_losses

    def by_storage(self) -> List[List[SavedPack]]:
        """The uncovered packs, grouped by storage, in packing order."""
        groups: Dict[int, List[SavedPack]] = {}
        for pack in self.packs:
            groups.setdefault(pack.ptr, []).append(pack)
        out = []
        for ptr, packs in groups.items():
            if ptr in self.counted_storages:
                continue
            left = [p for p in packs if not self.covered(p)]
            if left:
                out.append(left)
        return out

    def is_resident(self, pack: SavedPack) -> bool:
        """A Parameter's or buffer's storage: alive before the step."""
        return pack.ptr in self.resident_storages

    def is_constant(self, pack: SavedPack) -> bool:
        """The same bytes at any batch."""
        return self.is_resident(pack) or pack.ptr in self.parameter_gradients

    def by_owner(self) -> Dict[tuple, int]:
        """``(owner, kind) -> bytes`` of the uncovered storages."""
        per_owner: Dict[tuple, int] = {}
        for packs in self.by_storage():
            key = (packs[0].owner, packs[0].kind)
            per_owner[key] = per_owner.get(key, 0) + packs[0].nbytes
        return per_owner


def _traced_step(model: nn.Module, size: Sequence[int], batch: int
                 ) -> Tuple[List[SavedItem], Dict[tuple, int]]:
    """One traced step at ``batch``: the rules' items (per image) and the
    measured bytes of what no rule covers, ``(path, kind) -> bytes``."""
    items: List[SavedItem] = []
    shared: Dict[int, Tuple[str, Any]] = {}
    unmodelled = UnmodelledBytes.of(model)

    def on_call(call: ModuleCall) -> None:
        if not call.recorded or not isinstance(call.output, torch.Tensor):
            return
        found, modelled = kept_by_call(model, call.path, call.module, call.x,
                                       call.output, shared)
        unmodelled.note_call(call.seq, call.path, found, modelled)
        items.extend(i for i in found if not i.estimate)

    tracer = StepTracer(model, on_call, on_pack=unmodelled.on_pack)
    with tracer.hooked():
        tracer.step(random_batch(model, size, batch,
                                 device=model_device(model)))
    return items, unmodelled.by_owner()


def _per_batch(path: str, kind: str, one: int, two: int) -> List[SavedItem]:
    """Measured bytes at batch 1 and 2 as a per-image and a constant part
    (bytes that do not grow with the batch: a loss's class weights, 0-dim
    scalars); linear in the batch from batch 1 where the two do not fit
    that (a loss keeping a data-dependent number of pixels)."""
    per_image, constant = two - one, 2 * one - two
    if per_image < 0 or constant < 0:
        return [measured_item(path, kind, one)]
    return [measured_item(path, kind, n, const) for n, const in
            ((per_image, False), (constant, True)) if n]


def trace_step_saved_bytes(model: nn.Module,
                           input_size: Sequence[int]) -> StepSavedBytes:
    """What one training step of ``model`` keeps for backward.

    One step at batch 1 is traced and each recorded call's rule
    (:func:`~.kept.kept_by_call`) gives its bytes per image. What no rule
    covers is measured (:class:`UnmodelledBytes`) in that step and in one
    at batch 2, which splits it into a per-image and a constant part
    (:func:`_per_batch`). The model's training flag is restored afterwards.
    """
    size = tuple(int(v) for v in input_size)
    result = StepSavedBytes(input_size=size)
    was_training = model.training
    try:
        result.items, one = _traced_step(model, size, 1)
        two = _traced_step(model, size, 2)[1] if one else {}
    finally:
        model.train(was_training)
    for (path, kind), nbytes in one.items():
        measured = _per_batch(path, kind, nbytes, two.get((path, kind), 0))
        result.items.extend(measured)
        result.unmodelled.append(path)
    return result
