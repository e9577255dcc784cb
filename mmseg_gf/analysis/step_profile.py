"""The cost of every "last N convs, radii" setting, and a budget's choice.

A user finetuning on a device knows its limits (bytes kept for backward,
peak memory of the step, backward FLOPs per image), not which ``N`` and
``r`` fit them. The paper's Section 5.4 finding (c): at a fixed compute
budget, training more layers with a coarser filter beats training fewer
layers exactly. So :func:`choose_by_budget` takes the largest ``N`` (the last
``N`` convs, as ``num_layers`` counts them) that fits at the coarsest
candidate radius, then spends what is left of the budget on finer radii,
coarsest maps first (the order of the ``'auto'`` rule: a patch on a 1/32 map
covers more image than on a 1/4 map).

Every candidate is costed analytically from one profile of the model
(:func:`profile_step_costs`): a single traced training forward at batch 1
that records, for every module autograd would record, what it keeps for
backward (the lean region's rules of :mod:`mmseg_gf.analysis.step_memory`)
and the last candidate conv upstream of its input. Which modules record
depends only on the first trained conv, so the bytes kept by a step that
trains the last ``N`` convs are a sum over the profile for every ``N`` and
radius assignment, equal to the count of the model actually built that way
(tested), which itself equals autograd's saved bytes. Backward FLOPs are the
single cost model's (:func:`~mmseg_gf.analysis.cost.conv_backward_cost`).
The step's peak is predicted from the same trace run under the profiler
(:meth:`StepCostProfile._peak`).
"""

import copy
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..engine.budget import LIMIT_KEYS, check_budget
from ..engine.selection import (ConvRecord, LayerChoice, is_classifier,
                                select_layers, trace_convs)
from ..engine.surgery import apply_gradient_filter, set_frozen_norms_eval
from ..engine.utils import unwrap_model
from .cost import conv_backward_cost
from .memory import live_bytes_by_interval, mark
from .step_memory import SavedItem, is_head_lean, item_for_module

__all__ = [
    'ConvProfile', 'StepCostProfile', 'StepCost', 'BudgetChoice',
    'profile_step_costs', 'choose_by_budget', 'choose_layers_by_budget',
    'PEAK_HEADROOM'
]

MIB = 2**20
#: A setting fits a ``peak_mib`` limit when its predicted peak is at most
#: this fraction of it: predictions are within 10% of the measured peak
#: (tests/test_engine/test_budget.py), so the measured peak stays within the limit.
PEAK_HEADROOM = 0.9

@dataclass
class ConvProfile:
    """A candidate conv (one of the last-``N`` pool).

    Attributes:
        choice: its selection record (path, shapes at the profile's input
            size, kernel geometry).
        index: position in the pool (execution order).
        upstream: index of the last pool conv its input depends on (-1:
            none); it computes ``g_x`` when that conv is trained.
        output_stride: input pixels per output pixel.
        params: its parameter count (weight and bias).
        seq: position of its call among the traced module calls.
    """

    choice: LayerChoice
    index: int
    upstream: int
    output_stride: int
    params: int
    seq: int = 0

    @property
    def path(self) -> str:
        return self.choice.path

    def cost(self, radius: int, first: int, batch: int = 1):
        """Its backward cost when the pool is trained from ``first`` on."""
        c = self.choice
        return conv_backward_cost(
            cin=c.in_shape[0], cout=c.out_shape[0], kh=c.kernel_size[0],
            kw=c.kernel_size[1], stride=c.stride, dilation=c.dilation,
            groups=c.groups, in_hw=c.in_shape[1:], out_hw=c.out_shape[1:],
            batch=batch, radius=radius,
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
        peak_bytes: predicted peak of live tensor bytes during the step
            (None when the profile has no peak model).
    """

    num_layers: int
    radii: Dict[str, int]
    batch: int
    saved_bytes: int
    backward_flops: int
    peak_bytes: Optional[int] = None

    @property
    def saved_mib(self) -> float:
        return self.saved_bytes / MIB

    @property
    def peak_mib(self) -> Optional[float]:
        return None if self.peak_bytes is None else self.peak_bytes / MIB

    @property
    def backward_gflops(self) -> float:
        return self.backward_flops / 1e9

    def value(self, key: str) -> Optional[float]:
        """A limit key's figure (MiB, GFLOPs per image)."""
        return getattr(self, key)

    def fits(self, limits: Dict[str, Optional[float]]) -> bool:
        """Every given limit holds; the predicted peak with
        :data:`PEAK_HEADROOM` to spare (its tested accuracy)."""
        return all(
            limit is None or self.value(key) <= limit *
            (PEAK_HEADROOM if key == 'peak_mib' else 1)
            for key, limit in limits.items())

    def describe(self) -> str:
        peak = ('' if self.peak_bytes is None else
                f', step peak {self.peak_mib:.1f} MiB')
        return (f'{self.backward_gflops:.3f} backward GFLOPs per image, '
                f'{self.saved_mib:.1f} MiB kept for backward{peak} '
                f'(batch {self.batch})')


@dataclass
class _Lifetime:
    """A module output that needs a gradient, in the batch-1 trace: the
    call that made it, the last candidate behind it, its bytes, and the
    call during which it was freed (None: it outlived the trace)."""

    made: int
    upstream: int
    nbytes: int
    freed: Optional[int] = None


@dataclass
class _Entry:
    """A module the profile saw record: what it keeps, and from where."""

    item: Optional[SavedItem]
    upstream: int
    trained: bool
    path: str
    seq: int = 0


@dataclass
class StepCostProfile:
    """The costs of every "last N, radii" setting of one segmentor.

    Built by :func:`profile_step_costs`; see the module docstring.

    Attributes:
        input_size: ``(H, W)`` of the profile.
        convs: the candidate convs, execution order.
        entries: recorded non-candidate modules and what they keep.
        classifiers: ``(cost function, upstream index)`` of each trained
            classifier (exact backward).
        classifier_params: parameters of the classifiers.
        live: live tensor bytes of the traced forward (nothing kept for
            backward) during each module call, ``(batch 1, batch 2)`` pairs
            in call order, plus what follows the last call; None when the
            profile was made without ``timeline``.
    """

    input_size: Tuple[int, int]
    convs: List[ConvProfile] = field(default_factory=list)
    entries: List[_Entry] = field(default_factory=list)
    classifiers: List[Tuple[Any, int]] = field(default_factory=list)
    classifier_params: int = 0
    classifier_seqs: List[int] = field(default_factory=list)
    tensors: List[_Lifetime] = field(default_factory=list)
    workspaces: Dict[Tuple[tuple, int, bool], Tuple[int, int]] = field(
        default_factory=dict, repr=False)
    live: Optional[List[Tuple[int, int]]] = None

    @property
    def max_layers(self) -> int:
        return len(self.convs)

    def first_index(self, num_layers: int) -> int:
        if not 1 <= num_layers <= self.max_layers:
            raise ValueError(f'num_layers must be in [1, {self.max_layers}]'
                             f', got {num_layers!r}')
        return self.max_layers - num_layers

    def unmodelled(self, num_layers: int) -> List[str]:
        """Recorded modules no lean rule covers (their bytes not counted)."""
        first = self.first_index(num_layers)
        return [e.path for e in self.entries
                if e.item is None and e.path and
                (e.trained or e.upstream >= first)]

    def radii_for(self, num_layers: int,
                  radius: Any) -> Dict[str, int]:
        """``radius`` (int, or path -> int) for the trained convs."""
        convs = self.convs[self.first_index(num_layers):]
        if isinstance(radius, dict):
            return {c.path: int(radius[c.path]) for c in convs}
        return {c.path: int(radius) for c in convs}

    def cost(self, num_layers: int, radius: Any, batch: int = 1) -> StepCost:
        """The step cost of training the last ``num_layers`` convs.

        Args:
            num_layers: how many of the candidate convs (the last ones).
            radius: an int for all, or ``{path: int}``.
            batch: images per step.
        """
        first = self.first_index(num_layers)
        radii = self.radii_for(num_layers, radius)
        saved = 0
        flops = 0
        for conv in self.convs[first:]:
            c = conv.cost(radii[conv.path], first, batch=1)
            saved += c.gf_saved_bytes * batch
            flops += c.gf_flops
        for entry in self.entries:
            if entry.item is not None and (entry.trained
                                           or entry.upstream >= first):
                saved += entry.item.nbytes(batch)
        for cost_of, upstream in self.classifiers:
            flops += cost_of(upstream >= first).vanilla_flops
        result = StepCost(num_layers=num_layers, radii=radii, batch=batch,
                          saved_bytes=saved, backward_flops=flops)
        if self.live is not None:
            result.peak_bytes = self._peak(first, radii, batch)
        return result

    def workspace(self, conv: ConvProfile, radius: int,
                  need_input_grad: bool, batch: int) -> int:
        """Scratch bytes of one filtered conv's backward beyond its
        results (``g_x``, ``g_W``), linear in the batch from runs at batch
        1 and 2 of the conv alone (measured once per conv geometry and
        radius: convs of one shape, as in a ResNet stage, share it)."""
        key = (_geometry(conv.choice.module, conv.choice.in_shape), radius,
               need_input_grad)
        if key not in self.workspaces:
            self.workspaces[key] = tuple(
                _backward_scratch(conv, radius, need_input_grad, n)
                for n in (1, 2))
        one, two = self.workspaces[key]
        return max(0, one + (batch - 1) * (two - one))

    def _peak(self, first: int, radii: Dict[str, int], batch: int) -> int:
        """The step's peak of live tensor bytes, predicted.

        Forward: during module call ``k``, the traced forward's live bytes
        (linear in the batch: from the batch-1 and batch-2 traces, so that
        the per-image chunk of the loss stays one image) plus everything
        kept for backward by calls up to ``k``. Backward mirrors the
        forward: the gradient of a tensor lives from its consumers'
        backward to its producer's, as the tensor lived from its producer
        to its consumers; at call ``k`` the gradients of the tensors that
        need one (those behind the first trained conv) and were alive
        there, what calls up to ``k`` kept, and the parameter gradients of
        the trained layers from ``k`` on are held, and during a filtered
        conv's backward its kernel's scratch buffers
        (:meth:`workspace`).
        """
        n = len(self.live)
        kept = [0] * n
        grads = [0] * n
        scratch = [0] * n
        for conv in self.convs[first:]:
            r = radii[conv.path]
            kept[conv.seq] += conv.cost(r, first,
                                        batch=1).gf_saved_bytes * batch
            grads[conv.seq] += 4 * conv.params
            scratch[conv.seq] = self.workspace(conv, r, conv.upstream >= first,
                                               batch)
        for entry in self.entries:
            if entry.item is not None and (entry.trained
                                           or entry.upstream >= first):
                kept[entry.seq] += entry.item.nbytes(batch)
        for seq in self.classifier_seqs:
            grads[seq] += 4 * self.classifier_params // len(
                self.classifier_seqs)
        mirrored = [0] * (n + 1)
        for t in self.tensors:
            if t.upstream >= first:
                mirrored[t.made] += t.nbytes * batch
                mirrored[n if t.freed is None else t.freed] -= (t.nbytes *
                                                                 batch)
        start = self.convs[first].seq
        after = sum(grads)
        peak = after
        held = gradients = 0
        for k, (one, two) in enumerate(self.live):
            held += kept[k]
            after -= grads[k]
            gradients += mirrored[k]
            forward = one + (batch - 1) * (two - one)
            peak = max(peak, forward + held)
            if k >= start:
                # during call k's backward its own parameter gradient is
                # made while its output's gradient is still alive
                peak = max(peak,
                           held + gradients + after + grads[k] + scratch[k])
        return peak


def _geometry(conv: torch.nn.Conv2d, in_shape) -> tuple:
    """What a conv's backward scratch depends on: its input's shape and
    the conv's hyper-parameters."""
    return (tuple(in_shape), conv.in_channels, conv.out_channels,
            conv.kernel_size, conv.stride, conv.padding, conv.dilation,
            conv.groups, conv.padding_mode, conv.bias is not None)


def _backward_scratch(conv: ConvProfile, radius: int,
                      need_input_grad: bool, batch: int) -> int:
    """Peak bytes one filtered conv's backward allocates beyond its
    results, on random data of the conv's shapes."""
    from ..models.gf_conv import GFConv2d
    module = GFConv2d.from_conv(copy.deepcopy(conv.choice.module), radius)
    for p in module.parameters():
        p.requires_grad_(True)
    x = torch.randn((batch, ) + tuple(conv.choice.in_shape),
                    requires_grad=need_input_grad)
    y = module(x)
    grad = torch.randn_like(y)
    results = sum(p.numel() * p.element_size()
                  for p in module.parameters())
    if need_input_grad:
        results += x.numel() * x.element_size()
    peak = max(live_bytes_by_interval(
        lambda: torch.autograd.backward(y, grad), marker=None,
        collect=False))
    return max(0, peak - results)


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


def _pool(records: List[ConvRecord]) -> List[ConvRecord]:
    return [r for r in records if r.inference and not is_classifier(r.path)
            and r.feeds_output]


def profile_step_costs(model: nn.Module,
                       input_size: Sequence[int],
                       timeline: bool = False) -> StepCostProfile:
    """Profile a segmentor once for the costs of every last-``N`` setting.

    A copy of the model is prepared as gradient filtering would train all
    candidate convs (lean region on, classifier trained), then traced at
    batch 1 with the candidate convs frozen and each one's output replaced
    by a fresh tensor that requires a gradient and carries the conv's
    index: a module's input then depends on the candidates behind it, found
    by walking autograd's graph to those tensors. Nothing is kept for
    backward during the trace. The model itself is not changed.

    Args:
        model: an mmseg segmentor (plain, not yet gradient-filtered).
        input_size: ``(H, W)`` (the training crop).
        timeline: also run the trace at batch 1 and 2 under the CPU
            profiler, recording live tensor bytes per module call, for the
            step peak (:attr:`StepCost.peak_bytes`); three traces instead
            of one.
    """
    from .model_cost import random_batch
    model = unwrap_model(model)
    size = (int(input_size[0]), int(input_size[1]))
    records = trace_convs(model, size)
    pool = _pool(records)
    if not pool:
        raise ValueError(
            f'gradient_filter budget: {type(model).__name__} runs no conv '
            'that the output depends on besides its classifier')
    probe = copy.deepcopy(model)
    choices = select_layers(probe, num_layers=len(pool), radius=1,
                            input_size=size)
    # every candidate trained with the exact backward: their outputs carry
    # autograd nodes to tag, and (nothing being kept) memory behaves as in
    # a step where they run frozen or filtered
    apply_gradient_filter(probe, choices, mode='vanilla', lean=True)
    index = {c.module: i for i, c in enumerate(choices)}
    profile = StepCostProfile(input_size=size)
    names = {m: n for n, m in probe.named_modules()}
    tags: Dict[Any, int] = {}
    memo: Dict[Any, int] = {}
    shared: Dict[int, str] = {}
    calls = [0]
    recording = [True]
    alive: Dict[int, _Lifetime] = {}

    def track(output: torch.Tensor, seq: int, upstream: int) -> None:
        """Note when a tensor that needs a gradient is made and freed."""
        if not output.requires_grad or id(output) in alive:
            return  # an in-place result is the tensor already tracked
        life = _Lifetime(seq, upstream, output.nbytes)
        profile.tensors.append(life)
        alive[id(output)] = life

        def freed(key=id(output), life=life):
            life.freed = calls[0]
            alive.pop(key, None)

        weakref.finalize(output, freed)

    def on_candidate(module, args, output):
        i = index[module]
        seq = calls[0]
        calls[0] += 1
        mark()
        if not recording[0] or not isinstance(output, torch.Tensor) or \
                output.grad_fn is None:
            return
        # inputs made by functional code (torch.cat, additions) are seen
        # here first
        track(args[0], seq, _max_upstream(args[0], tags, memo))
        tags[output.grad_fn] = i
        track(output, seq, i)
        if all(c.index != i for c in profile.convs):
            profile.convs.append(ConvProfile(
                choice=choices[i], index=i,
                upstream=_max_upstream(args[0], tags, memo),
                output_stride=max(1, round(size[0] / output.shape[-2])),
                params=sum(p.numel() for p in module.parameters()),
                seq=seq))

    def on_module(module, args, output):
        seq = calls[0]
        calls[0] += 1
        mark()
        if not recording[0] or not args or not isinstance(
                args[0], torch.Tensor) or not isinstance(output, torch.Tensor):
            return
        x = args[0]
        trained = any(p.requires_grad for p in module.parameters())
        if not torch.is_grad_enabled() or not (x.requires_grad or trained):
            return
        path = names[module]
        upstream = _max_upstream(x, tags, memo)
        track(x, seq, upstream)
        track(output, seq, max(upstream, _max_upstream(output, tags, memo)))
        try:
            item = item_for_module(path, module, x, output, shared)
        except LookupError:
            profile.entries.append(
                _Entry(None, upstream, trained, path, seq))
            return
        if item is not None:
            profile.entries.append(
                _Entry(item, upstream, trained, path, seq))
        if is_classifier(path) and trained:
            conv = module
            up = upstream

            def classifier_cost(need_input_grad, conv=conv, x=x,
                                out=output):
                return conv_backward_cost(
                    cin=x.shape[1], cout=out.shape[1],
                    kh=conv.kernel_size[0], kw=conv.kernel_size[-1],
                    stride=conv.stride, dilation=conv.dilation,
                    groups=conv.groups, in_hw=x.shape[2:],
                    out_hw=out.shape[2:], batch=1, radius=1,
                    need_input_grad=need_input_grad)

            profile.classifiers.append((classifier_cost, up))
            profile.classifier_params += sum(
                p.numel() for p in module.parameters())
            profile.classifier_seqs.append(seq)
            if is_head_lean(probe, path):
                profile.entries.append(_Entry(
                    SavedItem(path.rpartition('.')[0], 'logits',
                              output[0].numel(), output.element_size()),
                    up, True, '', seq))

    handles = []
    for module in probe.modules():
        if module in index:
            handles.append(module.register_forward_hook(on_candidate))
        elif not any(True for _ in module.children()):
            handles.append(module.register_forward_hook(on_module))

    def trace(batch) -> None:
        inputs, samples = batch
        with torch.random.fork_rng(), \
                torch.autograd.graph.saved_tensors_hooks(_drop, _no_unpack):
            probe.train()
            set_frozen_norms_eval(probe)
            calls[0] = 0
            probe.loss(inputs, samples)

    try:
        trace(random_batch(probe, size, 1))
        recording[0] = False
        memo.clear()
        tags.clear()
        profile.convs.sort(key=lambda c: c.index)
        if timeline:
            # the hooks only count the calls now: the records are complete
            live = []
            for n in (1, 2):
                batch = random_batch(probe, size, n)
                live.append(live_bytes_by_interval(lambda: trace(batch)))
            if len(live[0]) != len(live[1]):
                raise RuntimeError(
                    'gradient_filter budget: the traces at batch 1 and 2 '
                    'ran different module calls; the step peak cannot be '
                    'predicted for this model')
            profile.live = list(zip(*live))
    finally:
        for h in handles:
            h.remove()
    return profile


def _drop(_):
    return None


def _no_unpack(_):
    raise RuntimeError('the budget profile keeps no activation for backward')


@dataclass
class BudgetChoice:
    """What :func:`choose_by_budget` chose, and why.

    Attributes:
        cost: the chosen setting's predicted cost.
        limits: the limits it had to fit.
        smallest: the cheapest setting (1 layer, coarsest radius).
    """

    cost: StepCost
    limits: Dict[str, Optional[float]]
    smallest: StepCost

    @property
    def num_layers(self) -> int:
        return self.cost.num_layers

    @property
    def radius(self) -> Dict[str, int]:
        return dict(self.cost.radii)

    def summary(self) -> str:
        given = ', '.join(f'{k} <= {v:g}' for k, v in self.limits.items()
                          if v is not None)
        radii = sorted(set(self.cost.radii.values()))
        return (f'budget ({given}): the last {self.num_layers} convs, radii '
                f'{radii}; predicted {self.cost.describe()}')


def _refine_order(profile: StepCostProfile,
                  num_layers: int) -> List[ConvProfile]:
    """Coarsest maps first, then from the output backwards."""
    convs = profile.convs[profile.first_index(num_layers):]
    return sorted(convs, key=lambda c: (-c.output_stride, -c.index))


def choose_by_budget(profile: StepCostProfile,
                     budget: Dict[str, Any],
                     batch: int) -> BudgetChoice:
    """The most layers, then the finest radii, that fit every limit.

    Args:
        profile: from :func:`profile_step_costs`.
        budget: checked by :func:`check_budget`.
        batch: images per step.

    Raises:
        ValueError: no setting fits; names the cheapest achievable cost.
    """
    budget = check_budget(budget)
    limits = {k: budget[k] for k in LIMIT_KEYS}
    if limits['peak_mib'] is not None and profile.live is None:
        raise ValueError('gradient_filter budget peak_mib needs a profile '
                         'made with timeline=True')
    radii = budget['radii']
    coarsest = radii[-1]
    smallest = profile.cost(1, coarsest, batch)
    best = None
    for n in range(profile.max_layers, 0, -1):
        cost = profile.cost(n, coarsest, batch)
        if cost.fits(limits):
            best = cost
            break
    if best is None:
        given = ', '.join(f'{k} <= {v:g}' for k, v in limits.items()
                          if v is not None)
        raise ValueError(
            f'gradient_filter budget ({given}) cannot be met: the cheapest '
            f'setting, the last conv alone at radius {coarsest}, needs '
            f'{smallest.describe()}; raise the limits or add a coarser '
            f'radius to budget radii (now {list(radii)})')
    current = dict(best.radii)
    order = _refine_order(profile, best.num_layers)
    for finer in reversed(radii[:-1]):
        for conv in order:
            if current[conv.path] <= finer:
                continue
            trial = dict(current, **{conv.path: finer})
            cost = profile.cost(best.num_layers, trial, batch)
            if cost.fits(limits):
                current, best = trial, cost
    return BudgetChoice(cost=best, limits=limits, smallest=smallest)


def choose_layers_by_budget(segmentor: nn.Module, budget: Dict[str, Any],
                            input_size: Sequence[int],
                            batch: Optional[int] = None) -> BudgetChoice:
    """Profile ``segmentor`` and choose the setting that fits ``budget``.

    Args:
        segmentor: the plain segmentor.
        budget: see :func:`~mmseg_gf.engine.budget.check_budget`.
        input_size: the training crop.
        batch: images per step, unless the budget names it (default 1).
    """
    budget = check_budget(budget)
    batch = budget['batch'] or batch or 1
    profile = profile_step_costs(segmentor, input_size,
                                 timeline=budget['peak_mib'] is not None)
    return choose_by_budget(profile, budget, batch)
