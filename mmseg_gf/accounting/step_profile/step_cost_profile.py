"""The query model: the costs of every "last N, radii" setting, summed
from one profile (docs/budget.md, "How the costs are predicted")."""
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from ...models.layer_kinds import LayerGeometry
from ...ops.conv.cost import ConvGeometry
from ...ops.linear.patch_mean_activation import (PatchPartition,
                                                 patch_mean_kept_elements)
from ..kept import SavedItem
from ..peak import Lifetime, backward_scratch, scratch_key, step_peak
from .candidate import ConvProfile, layer_kind_name
from .gelu_call import GeluCall
from .kept_entry import KeptEntry
from .step_cost import StepCost


@dataclass
class StepCostProfile:
    """The costs of every "last N, radii" setting of one segmentor.

    Built by :func:`~.profiling.profile_step_costs`.

    Attributes:
        input_size: ``(H, W)`` of the profile.
        convs: the candidate convs, execution order.
        entries: recorded non-candidate calls and what they keep.
        classifiers: ``(geometry, upstream index, seq)`` of each trained
            classifier call (exact backward).
        tensors: lifetimes of the module outputs that need a gradient.
        live: live bytes of the traced forward per call, ``(batch 1, batch
            2)`` pairs, plus what follows the last call; None without
            ``timeline``.
        gelu_calls: the GELU calls the patch-mean rule may take.
        optimizer_state_ratio: optimizer state bytes per trained parameter
            byte, counted in the step peak (0: none).
        process_base_bytes: what the process held before the step, for the
            process peak; None: not predicted."""

    input_size: Tuple[int, int]
    convs: List[ConvProfile] = field(default_factory=list)
    entries: List[KeptEntry] = field(default_factory=list)
    classifiers: List[Tuple[LayerGeometry, int, int]] = field(
        default_factory=list)
    classifier_params: int = 0
    tensors: List[Lifetime] = field(default_factory=list)
    workspaces: Dict[tuple, Tuple[int, int]] = field(default_factory=dict,
                                                     repr=False)
    live: Optional[List[Tuple[int, int]]] = None
    gelu_calls: List[GeluCall] = field(default_factory=list)
    optimizer_state_ratio: float = 0.0
    process_base_bytes: Optional[int] = None

    @property
    def max_layers(self) -> int:
        return len(self.convs)

    def first_index(self, num_layers: int) -> int:
        if not 1 <= num_layers <= self.max_layers:
            raise ValueError(f'num_layers must be in [1, {self.max_layers}]'
                             f', got {num_layers!r}')
        return self.max_layers - num_layers

    def unmodelled(self, num_layers: int) -> List[str]:
        """Modules keeping what no rule covers (their bytes measured)."""
        first = self.first_index(num_layers)
        return sorted({e.path for e in self.entries
                       if e.item.category == 'unmodelled'
                       and e.counted(first)})

    def radii_for(self, num_layers: int, radius: Any) -> Dict[str, int]:
        """``radius`` (int, or path -> int) for the trained convs."""
        convs = self.convs[self.first_index(num_layers):]
        if isinstance(radius, dict):
            return {c.path: int(radius[c.path]) for c in convs}
        return {c.path: int(radius) for c in convs}

    def patch_mean_gelus(self, num_layers: int,
                         radius: Any) -> Dict[str, PatchPartition]:
        """The GELUs (by path), with their partitions, that keep patch means of
        ``f'`` when the last ``num_layers`` are trained at ``radius``, as the
        engine's ``find_patch_mean_gelus`` decides on that model."""
        first = self.first_index(num_layers)
        return self._patch_mean_gelus(first,
                                      self.radii_for(num_layers, radius))

    def _patch_mean_gelus(self, first: int, radii: Dict[str, int]
                          ) -> Dict[str, PatchPartition]:
        parts: Dict[str, set] = {}
        paths = {c.index: c.path for c in self.convs}
        for call in self.gelu_calls:
            parts.setdefault(call.path, set()).add(
                call.rule_partition(first, radii, paths))
        return {path: next(iter(p)) for path, p in parts.items()
                if len(p) == 1 and None not in p}

    def _gelu_bytes(self, first: int, radii: Dict[str, int], batch: int
                    ) -> Tuple[set, List[Tuple[int, int]]]:
        """``(entries replaced, [(seq, bytes)] of the patch means)`` of
        the GELU calls the rule takes in this setting."""
        found = self._patch_mean_gelus(first, radii)
        replaced, means = set(), []
        for call in self.gelu_calls:
            part = found.get(call.path)
            if part is None:
                continue
            replaced.update(id(e) for e in call.entries)
            item = SavedItem(call.path, 'activation',
                             patch_mean_kept_elements(call.shape, part)
                             // call.shape[0], call.elem_bytes)
            means.append((call.seq, item.nbytes(batch)))
        return replaced, means

    def cost(self, num_layers: int, radius: Any, batch: int = 1) -> StepCost:
        """The step cost of training the last ``num_layers`` convs.

        Args:
            num_layers: how many of the candidate convs (the last ones).
            radius: an int for all, or ``{path: int}``.
            batch: images per step.
        """
        first = self.first_index(num_layers)
        radii = self.radii_for(num_layers, radius)
        saved = flops = 0
        for conv in self.convs[first:]:
            c = conv.cost(radii[conv.path], first)
            saved += c.gf_saved_bytes * batch
            flops += c.gf_flops
        replaced, means = self._gelu_bytes(first, radii, batch)
        saved += sum(e.item.nbytes(batch) for e in self.entries
                     if e.counted(first) and id(e) not in replaced)
        saved += sum(nbytes for _, nbytes in means)
        for geometry, upstream, _ in self.classifiers:
            flops += geometry.cost(
                1, need_input_grad=upstream >= first).vanilla_flops
        trained = self.convs[first:]
        result = StepCost(
            num_layers=num_layers, radii=radii, batch=batch,
            saved_bytes=saved, backward_flops=flops,
            optimizer_bytes=round(self.optimizer_state_ratio * 4 * (
                sum(c.params for c in trained) + self.classifier_params)),
            kinds=tuple(sorted({layer_kind_name(c.module) for c in trained})))
        if self.live is not None:
            result.peak_bytes = self._peak(first, radii, batch) + \
                result.optimizer_bytes
            if self.process_base_bytes is not None:
                result.process_bytes = self.process_base_bytes + \
                    result.peak_bytes
        return result

    def workspace(self, conv: ConvProfile, radius: int,
                  need_input_grad: bool, batch: int) -> int:
        """Scratch bytes of one filtered conv's backward
        (:func:`~..peak.backward_scratch`), linear in the batch, measured
        once per conv geometry and radius."""
        if not isinstance(conv.geometry, ConvGeometry):
            # a layer on tokens: its backward's scratch (patch sums of g_y
            # on 1/r^2 of the rows, the pooled g_x) is not measured; the
            # step peak of the tiny transformer families stays within 10%
            # without it (tests/test_engine/test_token_kinds_accounting.py)
            return 0
        in_shape = conv.input_shape or conv.geometry.in_shape
        key = scratch_key(conv.module, in_shape, radius, need_input_grad)
        if key not in self.workspaces:
            self.workspaces[key] = tuple(
                backward_scratch(conv.module, in_shape, radius,
                                 need_input_grad, n) for n in (1, 2))
        one, two = self.workspaces[key]
        return one + (batch - 1) * (two - one)

    def _peak(self, first: int, radii: Dict[str, int], batch: int) -> int:
        """:func:`~..peak.step_peak` of training from candidate ``first``."""
        n = len(self.live)
        kept, grads, scratch = [0] * n, [0] * n, [0] * n
        forward_kept = [0] * n
        for conv in self.convs[first:]:
            r = radii[conv.path]
            kept[conv.seq] += conv.cost(r, first).gf_saved_bytes * batch
            forward_kept[conv.seq] += conv.cost(r, first).gf_saved_bytes * \
                batch
            grads[conv.seq] += 4 * conv.params
            scratch[conv.seq] = self.workspace(conv, r, conv.upstream >= first,
                                               batch)
        replaced, means = self._gelu_bytes(first, radii, batch)
        for e in self.entries:
            if e.counted(first) and not e.resident and \
                    id(e) not in replaced:
                kept[e.seq] += e.item.nbytes(batch)
                at = e.forward_seq()
                if at is not None and at < n:
                    forward_kept[at] += e.item.nbytes(batch)
        for seq, nbytes in means:  # made by the GELU's call
            kept[seq] += nbytes
            forward_kept[seq] += nbytes
        for _, _, seq in self.classifiers:
            grads[seq] += 4 * self.classifier_params // len(self.classifiers)
        return step_peak(self.live, kept, grads, scratch, self.tensors, first,
                         self.convs[first].seq, batch, forward_kept)
