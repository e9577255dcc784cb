"""The cost of every "last N convs, radii" setting, from one profile.

A budget is met by choosing how many of a segmentor's last convs to train
and at which radii (:mod:`.budget`); trying each setting would cost a model
build and a step apiece. Instead :func:`profile_step_costs` traces one
training step (:class:`~.trace.StepTracer`) of a *probe*: the segmentor
prepared as if every candidate conv were trained, and records, for every
call autograd would record, what it keeps for backward (the rules of
:mod:`.kept`) and the last candidate conv upstream of its input. Which
modules record depends only on the first trained conv, so the bytes kept by
a step that trains the last ``N`` convs are a sum over the profile for every
``N`` and radius assignment, equal to the count of the model actually built
that way (tested), which itself equals autograd's saved bytes. Backward
FLOPs are the single cost model's (:mod:`mmseg_gf.ops.conv_cost`); the
step's peak is the peak model's (:mod:`.peak`).

With ``patch_mean_activations`` the profile also models the patch-mean
GELU rule (:mod:`mmseg_gf.engine.patch_mean_activations`): the trace
records, for each GELU call, the candidate whose output it reads unchanged
and the candidate calls consuming its output (the graph premises of
:mod:`mmseg_gf.models.patch_mean_graph`), with their partitions; a setting
counts a GELU by the patch means of ``f'`` (plus the tokens on no grid)
exactly where the rule would fire in the step trained that way: its
producer and all its consumers among the trained layers, at one radius, on
one partition (:meth:`StepCostProfile.patch_mean_gelus`).
"""
import dataclasses
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..models.layer_kinds import (CONV2D, LayerGeometry, layers_noun,
                                  traced_kind_of)
from ..models.patch_mean_graph import (LayerCall, filtered_users,
                                       graph_consumers, is_counted_partition,
                                       is_filtered_layer, is_plain_gelu)
from ..ops.conv_cost import ConvBackwardCost, ConvGeometry, map_output_stride
from ..ops.patch_mean_activation import (PatchPartition,
                                         patch_mean_kept_elements)
from .batch import random_batch
from .format import MIB
from .kept import SavedItem, kept_by_call, measured_item
from .kept_tokens import candidate_extra_items
from .measured import live_bytes_by_interval
from .peak import Lifetime, backward_scratch, scratch_key, step_peak
from .trace import ModuleCall, SavedPack, StepTracer, UnmodelledBytes

__all__ = ['ConvProfile', 'StepCost', 'StepCostProfile',
           'profile_step_costs']


def layer_geometry(module: nn.Module, x: torch.Tensor,
                   out: torch.Tensor) -> LayerGeometry:
    """A traced layer's geometry at one call, from its layer kind (a
    classifier not of a registered kind counts as a conv)."""
    kind = traced_kind_of(module) or CONV2D
    return kind.geometry(module, (x, ), out)


def _kind_name(module: nn.Module) -> str:
    """A candidate's layer kind (a module of no registered kind: a conv,
    as :func:`layer_geometry` counts it)."""
    kind = traced_kind_of(module)
    return CONV2D.name if kind is None else kind.name


@dataclass
class ConvProfile:
    """A candidate conv (one of the last-``N`` pool).

    Attributes:
        path: its module path.
        module: the conv.
        geometry: its shapes at the profile's input size.
        index: position in the pool (execution order).
        upstream: index of the last pool conv its input depends on (-1:
            none); it computes ``g_x`` when that conv is trained.
        output_stride: input pixels per output pixel.
        params: its parameter count (weight and bias).
        seq: position of its call among the traced module calls.
        input_shape: its input's shape at the traced call, without the
            batch axis (what its backward's scratch is measured on; the
            geometry's ``in_shape`` is ``(C, H, W)`` on the kind's grid,
            which a 1-D conv's input, ``(C, L)``, is not).
    """

    path: str
    module: nn.Module
    geometry: LayerGeometry
    index: int
    upstream: int
    output_stride: int
    params: int
    seq: int = 0
    input_shape: Tuple[int, ...] = ()

    def cost(self, radius: int, first: int,
             batch: int = 1) -> ConvBackwardCost:
        """Its backward cost when the pool is trained from ``first`` on."""
        return self.geometry.cost(radius, batch=batch,
                                  need_input_grad=self.upstream >= first)


@dataclass
class StepCost:
    """Predicted cost of one training step of a setting.

    Attributes:
        num_layers: trained convs besides the classifier.
        radii: path -> radius of each trained conv.
        batch: images per step.
        saved_bytes: bytes kept for backward by the whole step.
        backward_flops: backward FLOPs per image, trained convs and
            classifier.
        peak_bytes: predicted peak of live tensor bytes during the step,
            the optimizer's state included (None when the profile has no
            peak model).
        optimizer_bytes: the optimizer's state for the trained parameters
            (:mod:`.optimizer_state`; 0 when no optimizer was given).
        process_bytes: predicted peak of the process: what it held when
            the profile was made (``StepCostProfile.process_base_bytes``)
            plus ``peak_bytes``; None without a base or a peak model.
        kinds: the layer kinds of the trained layers.
    """

    num_layers: int
    radii: Dict[str, int]
    batch: int
    saved_bytes: int
    backward_flops: int
    peak_bytes: Optional[int] = None
    optimizer_bytes: int = 0
    process_bytes: Optional[int] = None
    kinds: Tuple[str, ...] = ()

    @property
    def saved_mib(self) -> float:
        return self.saved_bytes / MIB

    @property
    def peak_mib(self) -> Optional[float]:
        return None if self.peak_bytes is None else self.peak_bytes / MIB

    @property
    def process_mib(self) -> Optional[float]:
        return None if self.process_bytes is None else \
            self.process_bytes / MIB

    @property
    def backward_gflops(self) -> float:
        return self.backward_flops / 1e9

    @property
    def layer_noun(self) -> str:
        """``'convs'`` when every trained layer is a conv, else
        ``'layers'``."""
        return layers_noun(self.kinds)

    def value(self, key: str) -> Optional[float]:
        """A limit key's figure (MiB, GFLOPs per image)."""
        return getattr(self, key)

    def describe(self) -> str:
        peak = ''
        if self.peak_bytes is not None:
            state = (f' with {self.optimizer_bytes / MIB:.1f} MiB of '
                     'optimizer state' if self.optimizer_bytes else '')
            peak = f', step peak {self.peak_mib:.1f} MiB{state}'
        if self.process_bytes is not None:
            peak += f', process peak {self.process_mib:.1f} MiB'
        return (f'{self.backward_gflops:.3f} backward GFLOPs per image, '
                f'{self.saved_mib:.1f} MiB kept for backward{peak} '
                f'(batch {self.batch})')


@dataclass
class _Entry:
    """A recorded non-candidate call (or a measured storage): what it keeps,
    the last candidate behind its input, and whether it is trained."""

    item: Optional[SavedItem]
    upstream: int
    trained: bool
    path: str
    seq: int = 0
    #: the call from which the traced forward no longer holds the kept
    #: storage itself (a measured storage that is a live tensor of the
    #: forward, e.g. a GroupNorm's input, is in the trace's live bytes
    #: until then); None: ``seq``; -1: never (it outlives the trace)
    live_from: Optional[int] = None
    #: the storage of a Parameter or buffer (a view of a weight saved by a
    #: product): kept bytes, but alive before the step, so never in its
    #: live bytes
    resident: bool = False

    def forward_seq(self) -> Optional[int]:
        """The call from which the forward's live bytes lack it."""
        if self.live_from is None:
            return self.seq
        return None if self.live_from < 0 else max(self.seq,
                                                   self.live_from + 1)

    def counted(self, first: int) -> bool:
        """Autograd records it when training from candidate ``first``."""
        return self.trained or self.upstream >= first


@dataclass
class _GeluCall:
    """A GELU call of the probe the patch-mean rule may take.

    Attributes:
        path: the GELU's module path.
        entries: the entries of what its plain rule keeps (replaced by the
            patch means where the rule fires).
        shape: its input's shape (one image).
        elem_bytes: its input's element size.
        seq: its call's position.
        producer: the candidate whose output it reads unchanged (-1: none,
            or one whose filtered call would run the exact backward).
        partition: that output's patches at the probe's radius.
        users: the candidate calls consuming its output, when every node
            consuming it is one (None: the rule never fires).
        node: its output's autograd node (only during the trace).
    """

    path: str
    entries: List['_Entry']
    shape: Tuple[int, ...]
    elem_bytes: int
    seq: int
    producer: int = -1
    partition: Optional[PatchPartition] = None
    users: Optional[List[LayerCall]] = None
    node: Any = field(default=None, repr=False)

    def rule_partition(self, first: int, radii: Dict[str, int],
                       paths: Dict[int, str]) -> Optional[PatchPartition]:
        """The partition the rule keeps this call on when the candidates
        from ``first`` on are trained at ``radii`` (None: it does not
        fire): its producer and consumers trained at one radius, their
        patches the same (``paths``: candidate index -> path)."""
        if self.producer < first or not self.users or \
                self.partition is None:
            return None
        layers = [self.producer] + [u.layer for u in self.users]
        if min(layers) < first:
            return None
        radius = {radii[paths[i]] for i in layers}
        if len(radius) != 1 or any(u.partition != self.partition
                                   for u in self.users):
            return None
        part = dataclasses.replace(self.partition, radius=radius.pop())
        return part if is_counted_partition(part) else None


@dataclass
class StepCostProfile:
    """The costs of every "last N, radii" setting of one segmentor.

    Built by :func:`profile_step_costs`; see the module docstring.

    Attributes:
        input_size: ``(H, W)`` of the profile.
        convs: the candidate convs, execution order.
        entries: recorded non-candidate calls and what they keep.
        classifiers: ``(geometry, upstream index, seq)`` of each trained
            classifier call (exact backward).
        classifier_params: parameters of the classifiers.
        tensors: lifetimes of the module outputs that need a gradient.
        live: live tensor bytes of the traced forward (nothing kept for
            backward) during each module call, ``(batch 1, batch 2)`` pairs
            in call order, plus what follows the last call; None when the
            profile was made without ``timeline``.
        gelu_calls: the GELU calls the patch-mean rule may take (empty
            without ``patch_mean_activations``).
        optimizer_state_ratio: bytes of optimizer state per byte of
            trained parameter (measured by
            :func:`.optimizer_state.optimizer_state_ratio`), counted in
            the step peak; 0: none counted.
        process_base_bytes: what the process held before the step (its
            resident memory, or on CUDA the model's parameters and
            buffers), for the process peak; None: not predicted.
    """

    input_size: Tuple[int, int]
    convs: List[ConvProfile] = field(default_factory=list)
    entries: List[_Entry] = field(default_factory=list)
    classifiers: List[Tuple[LayerGeometry, int, int]] = field(
        default_factory=list)
    classifier_params: int = 0
    tensors: List[Lifetime] = field(default_factory=list)
    workspaces: Dict[tuple, Tuple[int, int]] = field(default_factory=dict,
                                                     repr=False)
    live: Optional[List[Tuple[int, int]]] = None
    gelu_calls: List[_GeluCall] = field(default_factory=list)
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
        """The GELUs (by path) that keep the patch means of ``f'`` when
        the last ``num_layers`` are trained at ``radius`` (``mode='gf'``,
        lean, ``patch_mean_activations``), with their partitions: where
        every call of the GELU meets the rule's premises on one partition,
        as ``find_patch_mean_gelus``
        (:mod:`mmseg_gf.engine.patch_mean_activations`) decides on the
        model trained that way."""
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
            kinds=tuple(sorted({_kind_name(c.module) for c in trained})))
        if self.live is not None:
            result.peak_bytes = self._peak(first, radii, batch) + \
                result.optimizer_bytes
            if self.process_base_bytes is not None:
                result.process_bytes = self.process_base_bytes + \
                    result.peak_bytes
        return result

    def workspace(self, conv: ConvProfile, radius: int,
                  need_input_grad: bool, batch: int) -> int:
        """Scratch bytes of one filtered conv's backward beyond its output's
        gradient and its results (negative where these are not all alive
        at once: :func:`~.peak.backward_scratch`), linear in the batch
        from runs at batch 1 and 2 of the conv alone (measured once per
        conv geometry and radius: convs of one shape, as in a ResNet
        stage, share it)."""
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
        """:func:`~.peak.step_peak` of training from candidate ``first``."""
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


def _max_upstream(tensor: torch.Tensor, tags: Dict[Any, int],
                  memo: Dict[Any, int]) -> int:
    """The largest tag among the autograd nodes behind ``tensor`` (the
    candidate convs' nodes are tagged with their index; -1: none)."""
    root = tensor.grad_fn
    if root is None:
        return -1
    if root in memo:
        return memo[root]
    # iterative post-order walk: a node's value is the max of its inputs'
    order, stack, seen = [], [root], {root}
    while stack:
        node = stack.pop()
        order.append(node)
        for child, _ in node.next_functions:
            if child is not None and child not in memo and child not in seen:
                seen.add(child)
                stack.append(child)
    for node in reversed(order):
        best = tags.get(node, -1)
        for child, _ in node.next_functions:
            if child is not None:
                best = max(best, memo.get(child, -1))
        memo[node] = best
    return memo[root]


#: the attribute the probe's candidate outputs carry for the patch-mean
#: rule: ``(index, version, partition)``
_PRODUCER_ATTR = '_gf_profile_producer'


def _nodes_reading(root, node) -> List[Any]:
    """The nodes behind ``root`` made after ``node`` (one layer call's,
    when ``node`` is its input's) that take ``node``'s output."""
    after = node._sequence_nr()
    readers, seen, stack = [], set(), [root]
    while stack:
        current = stack.pop()
        if current is None or current is node or current in seen:
            continue
        seen.add(current)
        if current._sequence_nr() <= after:
            continue
        for child, _ in current.next_functions:
            if child is node:
                readers.append(current)
            else:
                stack.append(child)
    return readers


def _loss_nodes(losses: Any) -> List[Any]:
    """The autograd nodes of the tensors in a ``model.loss`` result."""
    nodes, stack = [], [losses]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            if value.grad_fn is not None:
                nodes.append(value.grad_fn)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return nodes


class _Recorder:
    """Fills a :class:`StepCostProfile` from the calls of the batch-1 trace.

    Candidate convs run with the exact backward, their outputs' autograd
    nodes tagged with their index; any other call's input is walked back to
    the last tagged node (:func:`_max_upstream`). With ``patch_means``, the
    GELU calls and the filtered candidates' calls around them are noted for
    the patch-mean rule (:class:`_GeluCall`).
    """

    def __init__(self, probe: nn.Module, candidates: Sequence[nn.Module],
                 profile: StepCostProfile, is_classifier,
                 patch_means: bool = False) -> None:
        self.probe = probe
        self.patch_means = patch_means
        #: node -> the GELU call whose output it is
        self.gelu_nodes: Dict[Any, _GeluCall] = {}
        #: node -> the filtered candidate call reading a GELU's output
        self.layer_calls: Dict[Any, LayerCall] = {}
        self.index = {m: i for i, m in enumerate(candidates)}
        self.profile = profile
        self.is_classifier = is_classifier
        self.tags: Dict[Any, int] = {}
        self.memo: Dict[Any, int] = {}
        self.shared: Dict[int, Tuple[str, Any]] = {}
        self.alive: Dict[int, Lifetime] = {}
        self.tracer: Optional[StepTracer] = None
        self.unmodelled = UnmodelledBytes.of(probe)
        self.pack_upstream: Dict[int, Tuple[int, bool]] = {}
        self.pack_freed: Dict[int, int] = {}
        self.by_storage: Dict[int, List[Lifetime]] = {}
        #: path -> the last candidate behind what a module's own code saved
        #: in its current call
        self.own_code_upstream: Dict[str, int] = {}

    def upstream(self, tensor: torch.Tensor) -> int:
        return _max_upstream(tensor, self.tags, self.memo)

    def track(self, output: torch.Tensor, seq: int, upstream: int) -> None:
        """Note when a tensor that needs a gradient is made and freed."""
        if not output.requires_grad or id(output) in self.alive:
            return  # an in-place result is the tensor already tracked
        life = Lifetime(seq, upstream, output.nbytes)
        self.profile.tensors.append(life)
        self.alive[id(output)] = life
        ptr = output.untyped_storage().data_ptr()
        self.by_storage.setdefault(ptr, []).append(life)
        tracer, alive, by_storage = self.tracer, self.alive, self.by_storage

        def freed(key=id(output), life=life, ptr=ptr):
            life.freed = tracer.seq
            alive.pop(key, None)
            lives = by_storage.get(ptr, [])
            if life in lives:
                lives.remove(life)

        weakref.finalize(output, freed)

    def use(self, tensors, seq: Optional[int] = None) -> None:
        """Tensors read by an operation (or a module call) running during
        call ``seq`` (default: the call running now): the last use of the
        tracked tensors they are (or are views of)."""
        if seq is None:
            seq = self.tracer.seq
        for t in tensors:
            for life in self.by_storage.get(
                    t.untyped_storage().data_ptr(), ()):
                if life.last_use is None or life.last_use < seq:
                    life.last_use = seq

    def __call__(self, call: ModuleCall) -> None:
        if not isinstance(call.output, torch.Tensor):
            return
        if call.module in self.index:
            self.on_candidate(call)
        elif call.recorded:
            self.on_module(call)

    def on_candidate(self, call: ModuleCall) -> None:
        out = call.output
        if out.grad_fn is None:
            return
        i = self.index[call.module]
        self.unmodelled.note_call(call.seq, call.path, (), True)
        # inputs made by functional code (torch.cat, additions) are seen
        # here first
        upstream = self.upstream(call.x)
        self.track(call.x, call.seq, upstream)
        self.use([call.x], call.seq)
        self.tags[out.grad_fn] = i
        self.track(out, call.seq, i)
        if self.patch_means and is_filtered_layer(call.module):
            self.note_filtered_call(call, i)
        # what a trained attention's own code keeps besides its
        # projections (the profile skips the candidates' saved tensors)
        try:
            extra = candidate_extra_items(call.path, call.module,
                                          self.shared)
        except LookupError:
            raise ValueError(
                f'gradient_filter budget: what {call.path!r} keeps is not '
                'modelled (an attention whose probabilities dropout acts '
                'on in training); set its attention dropout to 0, or '
                "layer_kinds=['conv2d']") from None
        self.profile.entries.extend(
            _Entry(item, max(upstream, i), False, call.path, call.seq)
            for item in extra)
        if all(c.index != i for c in self.profile.convs):
            geometry = layer_geometry(call.module, call.x, out)
            self.profile.convs.append(ConvProfile(
                path=call.path, module=call.module, geometry=geometry,
                index=i, upstream=upstream,
                output_stride=map_output_stride(self.profile.input_size,
                                                geometry.map_area),
                params=sum(p.numel() for p in call.module.parameters()),
                seq=call.seq, input_shape=tuple(call.x.shape[1:])))

    def on_module(self, call: ModuleCall) -> None:
        x, out = call.x, call.output
        upstream = self.upstream(x)
        self.track(x, call.seq, upstream)
        self.use([x], call.seq)
        self.track(out, call.seq, max(upstream, self.upstream(out)))
        items, modelled = kept_by_call(self.probe, call.path, call.module, x,
                                       out, self.shared)
        self.unmodelled.note_call(call.seq, call.path, items, modelled)
        upstream, trained = self._owner_upstream(call, upstream)
        entries = [_Entry(item, upstream, trained, call.path, call.seq)
                   for item in items if not item.estimate]
        self.profile.entries.extend(entries)
        if self.patch_means and is_plain_gelu(call.module) and \
                out.grad_fn is not None:
            self.note_gelu(call, entries)
        if self.is_classifier(call.path) and call.trained:
            self.profile.classifiers.append(
                (layer_geometry(call.module, x, out),
                 upstream, call.seq))
            self.profile.classifier_params += sum(
                p.numel() for p in call.module.parameters())


    def note_filtered_call(self, call: ModuleCall, index: int) -> None:
        """A filtered candidate's call: mark its output with the patches
        its filtered call would tag it with (a GELU reading it keeps patch
        means of its derivative there), and, when it reads a GELU's
        output, note its nodes reading it as that GELU's consumer."""
        x, out = call.x, call.output
        part = call.module.output_partition(x, out)
        if part is None:  # its filtered call runs the exact backward
            return
        setattr(out, _PRODUCER_ATTR, (index, out._version, part))
        node = x.grad_fn
        if node is None or node not in self.gelu_nodes:
            return
        consumer = LayerCall(node, call.module.input_partition(x), index)
        for reader in _nodes_reading(out.grad_fn, node):
            self.layer_calls[reader] = consumer

    def note_gelu(self, call: ModuleCall, entries: List[_Entry]) -> None:
        """A plain GELU's call: what its rule kept and the candidate whose
        output (unchanged) it read."""
        x = call.x
        record = _GeluCall(call.path, entries, tuple(x.shape),
                           x.element_size(), call.seq,
                           node=call.output.grad_fn)
        tag = getattr(x, _PRODUCER_ATTR, None)
        if tag is not None and tag[1] == x._version:
            record.producer, record.partition = tag[0], tag[2]
        self.profile.gelu_calls.append(record)
        self.gelu_nodes[record.node] = record

    def resolve_gelus(self, losses: Any) -> None:
        """After the step: each GELU call's consumers, from the graph of
        ``losses`` (:func:`~mmseg_gf.models.patch_mean_graph.filtered_users`),
        and the graph's nodes let go."""
        if self.gelu_nodes:
            graph = graph_consumers(_loss_nodes(losses))
            for record in self.profile.gelu_calls:
                record.users = filtered_users(record.node, graph,
                                              self.layer_calls)
        for record in self.profile.gelu_calls:
            record.node = None
        self.gelu_nodes.clear()
        self.layer_calls.clear()

    def _owner_upstream(self, call: ModuleCall,
                        upstream: int) -> Tuple[int, bool]:
        """``(upstream, trained)`` of a call: for a module with children
        reported as a call (a lean attention), what its own code saved
        depends on the candidates behind the operation's inputs (Swin's
        ``qkv`` before its SDPA, not the ``proj`` after it:
        :meth:`on_pack` notes them), and it is trained by the parameters
        of its own and of its children that are no candidates."""
        if not any(True for _ in call.module.children()):
            return upstream, call.trained
        own = self.own_code_upstream.pop(call.path, None)
        trained = any(p.requires_grad for m in call.module.modules()
                      if m not in self.index
                      for p in m.parameters(recurse=False))
        return (upstream if own is None else own), trained

    def on_pack(self, pack: SavedPack) -> None:
        """A saved tensor: held (unless a candidate saved it) with the last
        candidate behind the inputs of the operation saving it: the
        operation records once that candidate is trained (or always, when
        an input is a trained Parameter). An operation with several
        activation inputs saves one of them for the others' gradients
        (``x * gate`` keeps ``gate`` for ``x``'s gradient and ``x`` for
        ``gate``'s): such a tensor is counted by the last candidate behind
        the other activation inputs. A tensor saved by an operation without
        another activation input (GELU's or a norm's input) is counted by
        its own."""
        if pack.module in self.index:
            return
        inputs = list(pack.inputs) or [pack.tensor]
        others = [t for t in inputs if not isinstance(t, nn.Parameter)
                  and t.untyped_storage().data_ptr() != pack.ptr]
        upstream = max(self.upstream(t) for t in (others or inputs))
        trained = any(t.requires_grad and t.grad_fn is None for t in inputs)
        if not pack.leaf and pack.module is not None:
            # a module's own code (a lean attention's SDPA call)
            self.own_code_upstream[pack.owner] = max(
                upstream, self.own_code_upstream.get(pack.owner, -1))
        kept = self.unmodelled.on_pack(pack)
        self.pack_upstream[id(kept)] = (upstream, trained)
        # when the trace frees the saved tensor (it keeps nothing itself):
        # until then the forward's live bytes hold it
        tracer, freed = self.tracer, self.pack_freed

        def on_free(key=id(kept)):
            freed[key] = tracer.seq

        # (a view made for the save dies at once: follow its base)
        base = pack.tensor._base
        weakref.finalize(pack.tensor if base is None else base, on_free)

    def measured_entries(self) -> List[_Entry]:
        """One entry per storage no rule covers, counted once any of the
        operations that saved it is recorded."""
        entries = []
        for packs in self.unmodelled.by_storage():
            marks = [self.pack_upstream[id(p)] for p in packs]
            first = packs[0]
            resident = self.unmodelled.is_resident(first)
            freed = [self.pack_freed.get(id(p), -1) for p in packs]
            entries.append(_Entry(
                measured_item(first.owner, first.kind, first.nbytes,
                              self.unmodelled.is_constant(first)),
                max(u for u, _ in marks), any(t for _, t in marks),
                first.owner, first.seq,
                live_from=None if resident else (
                    -1 if min(freed) < 0 else max(freed)),
                resident=resident))
        return entries


def profile_step_costs(probe: nn.Module, candidates: Sequence[nn.Module],
                       input_size: Sequence[int], is_classifier,
                       timeline: bool = False,
                       patch_mean_activations: bool = False
                       ) -> StepCostProfile:
    """Profile a prepared segmentor for the costs of every last-N setting.

    Args:
        probe: the segmentor prepared as gradient filtering trains every
            candidate conv with the exact backward (their outputs carry
            autograd nodes to tag, and, nothing being kept, memory behaves
            as in a step where they run frozen or filtered), the lean
            region on and the classifiers trained. Traced as it is; the
            trace keeps nothing for backward.
        candidates: the candidate convs of ``probe``, execution order.
        input_size: ``(H, W)`` (the training crop).
        is_classifier: path -> whether a conv is a decode-head classifier
            (trained by every setting; costed exactly).
        timeline: also run the trace at batch 1 and 2 under the CPU
            profiler, recording live tensor bytes per module call, for the
            step peak (:attr:`StepCost.peak_bytes`); three traces instead
            of one.
        patch_mean_activations: model the patch-mean GELU rule (the
            setting of the trained model: lean, ``mode='gf'``): each
            setting counts the GELUs the rule takes by their patch means
            (:meth:`StepCostProfile.patch_mean_gelus`).
    """
    size = (int(input_size[0]), int(input_size[1]))
    profile = StepCostProfile(input_size=size)
    recorder = _Recorder(probe, candidates, profile, is_classifier,
                         patch_means=patch_mean_activations)
    tracer = StepTracer(probe, recorder, marks=True,
                        on_pack=recorder.on_pack, operations=True)
    recorder.tracer = tracer
    tracer.operations.on_use = recorder.use
    with tracer.hooked():
        losses = tracer.step(random_batch(probe, size, 1), keep_saved=False)
        recorder.resolve_gelus(losses)
        del losses
        tracer.recording = False
        profile.entries.extend(recorder.measured_entries())
        recorder.unmodelled = UnmodelledBytes.of(probe)
        recorder.memo.clear()
        recorder.tags.clear()
        profile.convs.sort(key=lambda c: c.index)
        if timeline:
            profile.live = _live_per_call(tracer, probe, size)
    return profile


def _live_per_call(tracer: StepTracer, probe: nn.Module,
                   size: Tuple[int, int]) -> List[Tuple[int, int]]:
    """Live bytes per call of the traced forward at batch 1 and 2."""
    live = []
    for n in (1, 2):
        batch = random_batch(probe, size, n)
        live.append(live_bytes_by_interval(
            lambda: tracer.step(batch, keep_saved=False)))
    if len(live[0]) != len(live[1]):
        raise RuntimeError(
            'gradient_filter budget: the traces at batch 1 and 2 ran '
            'different module calls; the step peak cannot be predicted for '
            'this model')
    return list(zip(*live))
