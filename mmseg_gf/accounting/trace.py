"""The one step tracer: a record per leaf-module call of a training step.

The training log's saved bytes (:func:`~.saved_bytes.trace_step_saved_bytes`)
and the budget's profile (:func:`~.profile.profile_step_costs`) both come
from :class:`StepTracer`, so the two cannot disagree. A pack hook in the
same step measures what no rule of :mod:`.kept` covers, attributed to the
innermost running module."""
import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..models.layer_kinds import is_filtered
from ..models.lean_transformer import is_rule_owner
from ..models.segmentor import set_frozen_norms_eval
from ..ops.lean import kept_sources
from ..patching import Hooks, override, plain_class
from .kept import is_call_owner
from .measured import mark

__all__ = ['ModuleCall', 'SavedPack', 'StepTracer', 'LOSS_OWNER',
           'LOSS_PART']

#: What packs made outside every module's forward (and outside a head's
#: ``loss_by_feat``) are attributed to.
LOSS_OWNER = '(loss)'
#: Appended to a head's kind for what its ``loss_by_feat`` saves.
LOSS_PART = ' (loss)'


@dataclass
class ModuleCall:
    """One call of a leaf module (or a lean attention) during the traced step.

    Attributes:
        seq: position among all reported calls of the step.
        x: its first positional tensor argument, else None (a lean attention:
            its last tensor argument needing a gradient).
        trained: some parameter of it requires a gradient.
        recorded: autograd records the call; only recorded calls keep
            anything for backward.
    """

    seq: int
    path: str
    module: nn.Module
    x: Optional[torch.Tensor]
    output: Any
    trained: bool
    recorded: bool


@dataclass
class SavedPack:
    """A tensor autograd saved for backward during the traced step.

    Attributes:
        storage: held so the memory is not reused during the step without
            keeping the tensor alive.
        owner: the innermost running module's path (:data:`LOSS_OWNER`: none).
        kind: the owner's class name (`` (functional)`` for a module with
            children; :data:`LOSS_PART` for a head's ``loss_by_feat``).
        inputs: the saving operation's input tensors; empty unless the tracer
            follows operations."""

    tensor: Optional[torch.Tensor]
    storage: Any
    seq: int
    owner: str
    kind: str
    leaf: bool
    module: Optional[nn.Module] = None
    inputs: Sequence[torch.Tensor] = ()

    @property
    def ptr(self) -> int:
        return self.storage.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.storage.nbytes()

    def slim(self) -> 'SavedPack':
        """The pack without its tensor and inputs (what may be kept)."""
        return SavedPack(None, self.storage, self.seq, self.owner, self.kind,
                         self.leaf, self.module)


class _OperationInputs(TorchFunctionMode):
    """Arguments of the outermost torch function running: the operation a
    pack hook is called from."""

    def __init__(self) -> None:
        super().__init__()
        self.current = None
        #: called with the tensor arguments of every outermost torch
        #: function, when set and not :attr:`paused` (the tracer's own
        #: hooks read the tensors too)
        self.on_use: Optional[Callable[[List[torch.Tensor]], None]] = None
        self.paused = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        outer, self.current = self.current, (args, kwargs)
        if outer is None and self.on_use is not None and not self.paused:
            self.on_use(self.tensors())
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.current = outer

    def tensors(self) -> List[torch.Tensor]:
        if self.current is None:
            return []
        flat, _ = torch.utils._pytree.tree_flatten(self.current)
        return [t for t in flat if isinstance(t, torch.Tensor)]


def _reports_own_call(module: nn.Module) -> bool:
    """A module with children whose own code a kept rule counts (a lean or
    filtered attention, a registered call owner), reported as one call."""
    return (is_rule_owner(module) or is_filtered(module)
            or is_call_owner(module))


def _tensor_arguments(values) -> List[torch.Tensor]:
    """The tensors among ``values``, and those in lists or tuples among
    them (a decode head's input is a list of feature maps)."""
    out = []
    for value in values:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out


def _wraps_head(module: nn.Module) -> bool:
    """A decode head whose ``forward`` and ``loss_by_feat`` mmseg calls
    directly (from ``loss``), bypassing its module hooks."""
    return hasattr(module, 'loss_by_feat') and not {
        'forward', 'loss_by_feat'} & set(vars(module))


def _drop(_):
    return None


def _identity(tensor):
    return tensor


def _no_unpack(_):
    raise RuntimeError('a trace that keeps nothing cannot run backward')


class StepTracer:
    """Runs training steps of a segmentor, reporting every leaf call.

    Args:
        model: the segmentor (unwrapped), in the state it trains in.
        on_call, on_pack: called with each :class:`ModuleCall` /
            :class:`SavedPack` while :attr:`recording`.
        marks: a profiler mark at every call, for
            :func:`~.measured.live_bytes_by_interval`.
        operations: fill :attr:`SavedPack.inputs`."""

    def __init__(self, model: nn.Module,
                 on_call: Callable[[ModuleCall], None],
                 marks: bool = False,
                 on_pack: Optional[Callable[[SavedPack], None]] = None,
                 operations: bool = False) -> None:
        self.model = model
        self.on_call = on_call
        self.marks = marks
        self.on_pack = on_pack
        self.operations = _OperationInputs() if operations else None
        self.seq = 0
        self.recording = True
        self._paths = {m: n for n, m in model.named_modules()}
        self._stack: List[tuple] = []

    def _owner_hook(self, module, args, kwargs, output) -> None:
        """Reports a rule-owning module with children as one call (``x``: its
        tensor argument, positional or keyword; None: not recorded)."""
        tensors = _tensor_arguments(args) + _tensor_arguments(
            kwargs.values())
        # the last input needing a gradient (a key made from the query,
        # MiT's spatially reduced one, comes after it): whether the call
        # records, and the conv behind it
        grads = [t for t in tensors if t.requires_grad]
        if isinstance(output, (tuple, list)) and output:
            output = output[0]
        x = (grads or tensors)[-1:]
        if not x:
            # no tensor argument: nothing to tell whether it records
            x = [None]
        self._hook(module, x, output)

    def _hook(self, module, args, output) -> None:
        seq = self.seq
        self.seq += 1
        if self.marks:
            mark()
        if not self.recording:
            return
        with self._quiet():
            x = args[0] if args and isinstance(args[0], torch.Tensor) \
                else None
            trained = any(p.requires_grad for p in module.parameters())
            recorded = x is not None and torch.is_grad_enabled() and (
                x.requires_grad or trained)
            self.on_call(ModuleCall(seq, self._paths[module], module, x,
                                    output, trained, recorded))

    @contextlib.contextmanager
    def _quiet(self):
        """The tracer's own reading of tensors is no operation's use."""
        if self.operations is None:
            yield
            return
        self.operations.paused += 1
        try:
            yield
        finally:
            self.operations.paused -= 1

    def _enter(self, module, args, part: str = '') -> None:
        self._stack.append((module, args, part))

    def _leave(self, module, args, output) -> None:
        self._stack.pop()

    def _pack(self, tensor: torch.Tensor) -> None:
        """Report one saved tensor to :attr:`on_pack`."""
        if isinstance(tensor, nn.Parameter) or not self.recording:
            return
        with self._quiet():
            self._report_pack(tensor)

    def _report_pack(self, tensor: torch.Tensor) -> None:
        if self._stack:
            module, args, part = self._stack[-1]
            leaf = not any(True for _ in module.children())
            owner = self._paths.get(module, type(module).__name__)
            plain = plain_class(module)
            kind = plain.__name__ + (part or ('' if leaf else
                                              ' (functional)'))
        else:
            module, args, leaf, owner, kind = None, (), False, LOSS_OWNER, \
                LOSS_OWNER
        inputs = ()
        if self.operations is not None:
            # A custom Function's saved tensors are packed after its forward
            # returned, outside any operation: the lean losses name the
            # logits each kept gradient belongs to (ops.lean.kept_sources).
            inputs = (kept_sources.sources_of(tensor)
                      or self.operations.tensors()
                      or [a for a in args if isinstance(a, torch.Tensor)])
        self.on_pack(SavedPack(tensor, tensor.untyped_storage(), self.seq,
                               owner, kind, leaf, module, inputs))

    @contextlib.contextmanager
    def hooked(self):
        """Hooks on every leaf module (and the module stack's) for the block.
        """
        heads = [m for m in self.model.modules() if _wraps_head(m) and (
            self.on_pack is not None or _reports_own_call(m))]
        hooks = Hooks([
            m.register_forward_hook(self._hook) for m in self.model.modules()
            if not any(True for _ in m.children())
        ] + [
            m.register_forward_hook(self._owner_hook, with_kwargs=True)
            for m in self.model.modules()
            if any(True for _ in m.children()) and _reports_own_call(m)
            and m not in heads
        ])
        if self.on_pack is not None:
            for m in self.model.modules():
                hooks.add(m.register_forward_pre_hook(self._enter))
                hooks.add(m.register_forward_hook(self._leave,
                                                  always_call=True))
        undo = []
        for m in heads:  # each undo puts back an earlier instance method
            undo.append(override(m, 'forward',
                                 self._stacked(m, m.forward, '')))
            undo.append(override(m, 'loss_by_feat', self._stacked(
                m, m.loss_by_feat, LOSS_PART)))
        try:
            with hooks.removed_after():
                yield self
        finally:
            for u in reversed(undo):
                u()

    def _stacked(self, module: nn.Module, method: Callable,
                 part: str) -> Callable:
        """``method`` on the module stack: heads call ``forward`` and
        ``loss_by_feat`` from ``loss``, bypassing the module hooks."""
        report = part == '' and _reports_own_call(module)

        def run(*args, **kwargs):
            self._enter(module, args, part)
            try:
                output = method(*args, **kwargs)
            finally:
                self._stack.pop()
            if report:
                self._owner_hook(module, args, kwargs, output)
            return output

        return run

    def step(self, batch, keep_saved: bool = True) -> Dict[str, Any]:
        """One training forward + loss on ``(inputs, data_samples)``, as
        training runs it; the random state is restored afterwards.
        ``keep_saved=False``: autograd keeps nothing for backward."""
        inputs, samples = batch
        self.seq = 0
        self._stack.clear()
        saved = self._saved_hooks(keep_saved)
        operations = self.operations if (
            self.operations is not None and self.recording) else \
            contextlib.nullcontext()
        sources = kept_sources.recording() if self.on_pack is not None \
            else contextlib.nullcontext()
        with torch.random.fork_rng(), saved, operations, sources:
            self.model.train()
            set_frozen_norms_eval(self.model)
            return self.model.loss(inputs, samples)

    @contextlib.contextmanager
    def _saved_hooks(self, keep_saved: bool):
        """Autograd's pack hook: keep or drop, and report.

        The hook reaches the tracer through a holder emptied at the block's end
        and keeps a detached alias: otherwise the saved tensors' nodes and the
        tracer form a cycle through C++ the collector cannot see, and every
        traced model stayed alive (docs/benchmarks/design_measurements.md)."""
        if self.on_pack is None:
            with (contextlib.nullcontext() if keep_saved else
                  torch.autograd.graph.saved_tensors_hooks(_drop,
                                                           _no_unpack)):
                yield
            return
        holder = [self]

        def pack(tensor):
            if holder[0] is not None:
                holder[0]._pack(tensor)
            return tensor.detach() if keep_saved else None

        try:
            with torch.autograd.graph.saved_tensors_hooks(
                    pack, _identity if keep_saved else _no_unpack):
                yield
        finally:
            holder[0] = None
