"""Kernel launches of one training step, and the bytes they move, on the
path CUDA tensors take, counted on a CPU: at small sizes they bound a
step's time on any GPU. What counts, how bytes are counted and how
launches are attributed: docs/cost.md, "Kernel launches on the CUDA path".
"""
import contextlib
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..models import lean as lean_models
from ..models.layer_kinds import family_kind_of, kind_of
from ..models.lean import lean_kind
from ..models.lean_head import base_decode_head
from ..patching import Hooks, overridden
from .cuda_path import cuda_path

__all__ = ['PHASES', 'KINDS', 'NO_KERNEL', 'Launch', 'LaunchCount',
           'LaunchCounter', 'module_kind', 'counting', 'kernel_outputs',
           'count_step']

PHASES = ('forward', 'backward', 'optimizer')
#: What a launch is attributed to; ``patch_sums``: a filtered layer's
#: forward pooling of its input; ``fused_loss``: the classifier fused with
#: its loss; ``resized_loss``: a lean head's loss without that fusion;
#: ``loss``: the rest of a head's ``loss_by_feat``.
KINDS = ('activation', 'norm', 'patch_sums', 'fused_loss', 'resized_loss',
         'loss', 'filtered_conv', 'conv_block', 'filtered_linear', 'conv',
         'linear',
         'attention', 'dropout', 'pool', 'optimizer', 'other')
#: Operators that launch no kernel: allocations (uninitialised memory),
#: views the schema does not flag, metadata and dtype arithmetic.
NO_KERNEL = frozenset((
    'empty', 'empty_strided', 'empty_permuted', 'new_empty',
    'new_empty_strided', 'empty_like', 'detach', 'lift_fresh', 'alias',
    '_unsafe_view', '_reshape_alias', 'set_', 'resize_', 'sym_size',
    'sym_stride', 'sym_numel', 'sym_storage_offset', 'is_same_size',
    'promote_types', 'result_type', '_has_compatible_shallow_copy_type',
    '_fused_sdp_choice', 'record_stream', '_record_function_enter_new',
    '_record_function_exit'))
_HOST_READ = '_local_scalar_dense'

_LEAN_KINDS = {'norm': 'norm', 'layer_norm': 'norm', 'activation':
               'activation', 'patch_mean_gelu': 'activation', 'dropout':
               'dropout', 'drop_path': 'dropout', 'pool': 'pool',
               'attention': 'attention', 'frozen_conv': 'conv',
               'frozen_linear': 'linear', 'conv_block': 'conv_block'}
#: In ``torch.nn.modules.activation`` but an attention's parts (a softmax
#: goes to the module around it: the attention).
_NOT_ACTIVATIONS = (nn.Softmax, nn.Softmin, nn.LogSoftmax, nn.Softmax2d)
#: The modules of no layer kind with a kind of their own here.
_TYPES = ((nn.modules.batchnorm._NormBase, 'norm'),
          ((nn.GroupNorm, nn.LayerNorm), 'norm'),
          (nn.modules.dropout._DropoutNd, 'dropout'))


def module_kind(module: nn.Module) -> Optional[str]:
    """The kind (:data:`KINDS`) a module's launches go to, None for a
    container; the same for a lean module and its plain counterpart, so
    lean and vanilla steps compare kind by kind."""
    layer = kind_of(module)
    if layer is not None and layer.is_filtered(module):
        filtered = f'filtered_{layer.category}'
        return filtered if module.enabled and filtered in KINDS else \
            layer.category
    kind = _LEAN_KINDS.get(lean_kind(module))
    if kind is not None:
        return kind
    layer = family_kind_of(module)
    if layer is not None:
        return layer.category
    if type(module).__module__ == 'torch.nn.modules.activation' and \
            not isinstance(module, _NOT_ACTIVATIONS):
        return 'activation'
    for types, name in _TYPES:
        if isinstance(module, types):
            return name
    return None


@dataclass
class Launch:
    """One launch: its phase and kind, the operator (``aten.add.Tensor``,
    ``triton:_spread``), bytes read and written."""

    phase: str
    kind: str
    op: str
    read: int
    written: int


@dataclass
class LaunchCount:
    """Every launch of one counted step, in order, and the host reads
    (``.item()`` and the like) per phase."""

    launches: List[Launch] = field(default_factory=list)
    host_reads: Dict[str, int] = field(default_factory=dict)

    def select(self, phase: Optional[str] = None,
               kind: Optional[str] = None) -> List[Launch]:
        return [x for x in self.launches
                if phase in (None, x.phase) and kind in (None, x.kind)]

    def count(self, phase: Optional[str] = None,
              kind: Optional[str] = None) -> int:
        return len(self.select(phase, kind))

    def triton(self, phase: Optional[str] = None) -> int:
        return sum(x.op.startswith('triton:') for x in self.select(phase))

    def bytes_moved(self, phase: Optional[str] = None) -> int:
        return sum(x.read + x.written for x in self.select(phase))

    def by_kind(self, phase: Optional[str] = None) -> Dict[str, int]:
        """Launches per kind, in :data:`KINDS` order."""
        counts = Counter(x.kind for x in self.select(phase))
        return {k: counts[k] for k in KINDS if counts[k]}

    def bytes_by_kind(self, phase: Optional[str] = None) -> Dict[str, int]:
        """Bytes read and written per kind, as :meth:`by_kind`."""
        moved: Counter = Counter()
        for x in self.select(phase):
            moved[x.kind] += x.read + x.written
        return {k: moved[k] for k in self.by_kind(phase)}

    def by_op(self, phase: Optional[str] = None) -> Dict[str, int]:
        """Launches per operator, the most frequent first."""
        return dict(Counter(x.op for x in self.select(phase)).most_common())

    def summary(self) -> Dict:
        """Every count per phase and for the whole step (JSON-able)."""
        out = {}
        for phase in PHASES + (None, ):
            chosen = self.select(phase)
            out[phase or 'step'] = dict(
                launches=len(chosen), triton=self.triton(phase),
                read_bytes=sum(x.read for x in chosen),
                written_bytes=sum(x.written for x in chosen),
                host_reads=(sum(self.host_reads.values()) if phase is None
                            else self.host_reads.get(phase, 0)),
                by_kind=self.by_kind(phase),
                bytes_by_kind=self.bytes_by_kind(phase),
                by_op=self.by_op(phase))
        return out


def _distinct_elements(t: Tensor) -> int:
    """Elements ``t`` covers in memory (an expanded axis holds one)."""
    if t.numel() == 0:
        return 0
    count = 1
    for size, stride in zip(t.shape, t.stride()):
        count *= size if stride != 0 else 1
    return count


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += _distinct_elements(t) * t.element_size()
    return total


def _operands(func, args, kwargs) -> Tuple[list, list]:
    """Tensors ``func`` reads and writes in place, from its schema."""
    read, written = [], []
    schema = func._schema.arguments
    given = list(zip(schema, args)) + [(a, kwargs[a.name]) for a in schema
                                       if a.name in kwargs]
    for arg, value in given:
        writes = arg.alias_info is not None and arg.alias_info.is_write
        if writes:
            written.append(value)
        if not (writes and arg.kwarg_only):
            read.append(value)
    return tree_leaves(read), tree_leaves(written)


def _storages(module: nn.Module) -> frozenset:
    return frozenset(p.untyped_storage().data_ptr()
                     for p in (module.weight, getattr(module, 'bias', None))
                     if p is not None)


def _reads_any(tensors, storages: frozenset) -> bool:
    return any(isinstance(t, Tensor) and t.untyped_storage().data_ptr()
               in storages for t in tensors)


class _Scopes:
    """Open kind scopes, and each closed call's autograd sequence range."""

    def __init__(self) -> None:
        self.stack: List[Tuple[str, int, frozenset]] = []
        self.ranges: List[Tuple[int, int, int, str]] = []
        self._by_seq: Optional[Dict[int, str]] = None

    def enter(self, kind: str, storages: frozenset = frozenset()) -> None:
        self.stack.append(
            (kind, torch._C._autograd._get_sequence_nr(), storages))

    def exit(self) -> None:
        kind, start, _ = self.stack.pop()
        end = torch._C._autograd._get_sequence_nr()
        if end > start:
            self.ranges.append((start, end, len(self.stack), kind))

    def forward_kind(self, operands) -> str:
        if not self.stack:
            return 'other'
        kind, _, storages = self.stack[-1]
        if kind in ('filtered_conv', 'filtered_linear') and \
                not _reads_any(operands, storages):
            return 'patch_sums'
        return kind

    def backward_kind(self) -> str:
        node = torch._C._current_autograd_node()
        if node is None:
            return 'other'
        if self._by_seq is None:  # innermost call wins: paint outer first
            self._by_seq = {}
            for start, end, _, kind in sorted(self.ranges,
                                              key=lambda r: r[2]):
                self._by_seq.update(dict.fromkeys(range(start, end), kind))
        return self._by_seq.get(node._sequence_nr(), 'other')


class LaunchCounter(TorchDispatchMode):
    """Records :class:`Launch` es while active; :meth:`phase` sets the phase
    of the next ones. With ``run_kernels=False`` Triton kernels are counted,
    not run (see :func:`count_step`)."""

    def __init__(self, run_kernels: bool = True) -> None:
        super().__init__()
        self.result = LaunchCount()
        self.scopes = _Scopes()
        self.run_kernels = bool(run_kernels)
        self._phase = 'forward'
        self._inside_triton = 0
        self._skipped: Optional[str] = None

    def phase(self, name: str) -> None:
        if name not in PHASES:
            raise ValueError(f'phase must be one of {PHASES}, got {name!r}')
        self._phase = name

    def _kind(self, operands) -> str:
        if self._phase == 'optimizer':
            return 'optimizer'
        if self._phase == 'backward':
            return self.scopes.backward_kind()
        return self.scopes.forward_kind(operands)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if self._inside_triton or func.is_view or name in NO_KERNEL:
            return out
        if name == _HOST_READ:
            if self._skipped is not None:
                raise RuntimeError(
                    'launch accounting: a value is read on the host after '
                    f'the Triton kernel {self._skipped} was counted without '
                    'running it (run_kernels=False); what follows may '
                    'depend on its output: count with run_kernels=True')
            reads = self.result.host_reads
            reads[self._phase] = reads.get(self._phase, 0) + 1
            return out
        inputs, mutated = _operands(func, args, kwargs)
        self.result.launches.append(Launch(
            self._phase, self._kind(inputs), str(func), _bytes(inputs),
            _bytes(mutated + tree_leaves(out))))
        return out

    def triton_launch(self, name: str, inputs: Sequence,
                      outputs: Sequence, launch: Callable):
        """Record one Triton launch and run it (or zero its outputs)."""
        self.result.launches.append(Launch(
            self._phase, self._kind(inputs), f'triton:{name}',
            _bytes(inputs), _bytes(outputs)))
        self._inside_triton += 1
        try:
            if self.run_kernels:
                return launch()
            self._skipped = name
            for t in outputs:
                t.zero_()
            return None
        finally:
            self._inside_triton -= 1


@contextlib.contextmanager
def _counting_triton(counter: LaunchCounter) -> Iterator[None]:
    """Every Triton launch, interpreted or compiled, goes through
    ``counter``."""
    try:
        from triton.runtime.interpreter import GridExecutor
        from triton.runtime.jit import JITFunction
    except ImportError:  # no triton: nothing launches one
        yield
        return
    interpreted, compiled = GridExecutor.__call__, JITFunction.run

    def _launch(fn, arg_names, args, kwargs, run):
        written = kernel_outputs(fn)
        named = dict(zip(arg_names, args), **kwargs)
        tensors = {k: v for k, v in named.items() if isinstance(v, Tensor)}
        return counter.triton_launch(
            fn.__name__, [v for k, v in tensors.items() if k not in written],
            [v for k, v in tensors.items() if k in written], run)

    def launch_interpreted(self, *args, **kwargs):
        return _launch(self.fn, self.arg_names, args, kwargs,
                       lambda: interpreted(self, *args, **kwargs))

    def launch_compiled(self, *args, grid, warmup, **kwargs):
        def run():
            return compiled(self, *args, grid=grid, warmup=warmup, **kwargs)
        if warmup:
            return run()
        return _launch(self.fn, self.arg_names, args, kwargs, run)

    GridExecutor.__call__, JITFunction.run = (launch_interpreted,
                                              launch_compiled)
    try:
        yield
    finally:
        GridExecutor.__call__, JITFunction.run = interpreted, compiled


def kernel_outputs(fn) -> Tuple[str, ...]:
    """The arguments the Triton kernel ``fn`` writes, from its module's
    ``KERNEL_OUTPUTS`` (refused where the module names none)."""
    table = getattr(sys.modules.get(fn.__module__), 'KERNEL_OUTPUTS', {})
    if fn.__name__ not in table:
        raise RuntimeError(
            f'Triton kernel {fn.__module__}.{fn.__name__}: its module must '
            "name the arguments it writes in KERNEL_OUTPUTS (the launch "
            "accounting's bytes)")
    return tuple(table[fn.__name__])


@contextlib.contextmanager
def _scoped(model: nn.Module, scopes: _Scopes) -> Iterator[None]:
    """Module calls and lean loss functions open their kinds' scopes."""
    kinds = {id(m): (k, _storages(m) if k.startswith('filtered') else
                     frozenset())
             for m in model.modules() for k in [module_kind(m)] if k}

    def pre(module, args):
        entry = kinds.get(id(module))
        if entry is not None:
            scopes.enter(*entry)

    def post(module, args, output):
        if id(module) in kinds:
            scopes.exit()

    hooks = Hooks([nn.modules.module.register_module_forward_pre_hook(pre),
                   nn.modules.module.register_module_forward_hook(post)])
    with hooks.removed_after(), contextlib.ExitStack() as stack:
        for name, kind in (('fused_classifier_losses', 'fused_loss'),
                           ('lean_head_losses', 'resized_loss')):
            stack.enter_context(_wrapped(lean_models, name, kind, scopes))
        base = base_decode_head()
        for head in model.modules():
            if base is not None and isinstance(head, base):
                stack.enter_context(
                    _wrapped(head, 'loss_by_feat', 'loss', scopes))
        yield


def _wrapped(owner, name: str, kind: str, scopes: _Scopes):
    """``owner.name`` runs in a ``kind`` scope in the block."""
    original = getattr(owner, name)

    def scoped(*args, **kwargs):
        scopes.enter(kind)
        try:
            return original(*args, **kwargs)
        finally:
            scopes.exit()

    return overridden(owner, name, scoped)


@contextlib.contextmanager
def counting(counter: LaunchCounter,
             model: Optional[nn.Module] = None) -> Iterator[LaunchCounter]:
    """``counter`` records the block's launches by the kinds of ``model``'s
    modules (without a model: ``other``)."""
    with contextlib.ExitStack() as stack:
        if model is not None:
            stack.enter_context(_scoped(model, counter.scopes))
        stack.enter_context(_counting_triton(counter))
        stack.enter_context(counter)
        yield counter


def count_step(model: nn.Module, step: Callable[[Callable[[str], None]],
                                                None],
               warmup: int = 1, triton: bool = True,
               run_kernels: bool = True) -> LaunchCount:
    """The launches of one ``step(phase)`` of ``model`` on the CUDA path,
    after ``warmup`` uncounted steps (which create optimizer state and
    caches). ``step`` calls ``phase('backward')`` and ``phase('optimizer')``
    as it reaches them; ``run_kernels=False`` counts Triton launches
    without interpreting them (far faster, refused after a host read).
    """
    with cuda_path(triton=False):
        for _ in range(warmup):
            step(lambda name: None)
    with cuda_path(triton):
        counter = LaunchCounter(run_kernels)
        with counting(counter, model):
            step(counter.phase)
    if counter.scopes.stack:
        raise RuntimeError('launch accounting: a scope was left open '
                           f'({counter.scopes.stack[-1][0]})')
    return counter.result
