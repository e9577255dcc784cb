"""One place that chooses which implementation of an operator runs.

Each operator (``'conv'``, ``'linear'``, ...) has a priority list of
:class:`Implementation`, fastest first and its PyTorch reference last;
:func:`choose` takes the first that does not refuse the call and caches the
choice per call signature and switch state (a bounded LRU), and
:func:`explain` gives the path and every refusal. Operators register their
lists in ``ops/<operator>/__init__.py``; models, accounting and analysis
ask this module, never a backend predicate. Under ``torch.compile`` the
cache is skipped (its bookkeeping would be traced).
"""
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from . import availability, device_path, shape_caches, switches, triton_runtime

__all__ = ['Implementation', 'Choice', 'Operator', 'Explanation', 'CACHE_SIZE',
           'register', 'operator', 'choose', 'explain', 'refusal',
           'cache_info', 'misses',
           'cache_clear', 'switch_state', 'tensor_signature']

#: Call signatures kept per operator (least recently used dropped first).
CACHE_SIZE = 256

#: The switches whose state is part of every cached choice.
BACKEND_SWITCHES = ('MMSEG_GF_NATIVE', 'MMSEG_GF_TRITON',
                    'MMSEG_GF_FUSED_PRODUCTS', 'MMSEG_GF_RESIZE_GEMM',
                    'MMSEG_GF_CONV_BLOCKS')


@dataclass(frozen=True)
class Implementation:
    """One way to run an operator.

    Args:
        name: what :func:`explain` prints (``'triton'``, ``'c++'``,
            ``'gemm'``, ``'torch'``).
        refusal: ``refusal(*call)``: why it may not run the call, or None;
            reads tensor metadata only, since the choice is cached.
        run: what the operator runs when it is chosen.
        launch: ``launch(*call)``: launch arguments, cached with the choice.
    """
    name: str
    refusal: Callable[..., Optional[str]]
    run: Any = None
    launch: Optional[Callable[..., tuple]] = None


class Choice(NamedTuple):
    """The implementation chosen, its launch arguments and earlier refusals."""
    implementation: Implementation
    launch: tuple
    refusals: Tuple[Tuple[str, str], ...]


class Explanation(NamedTuple):
    """The operator, the implementation taken and every refusal before it."""
    operator: str
    path: str
    refusals: Tuple[Tuple[str, str], ...]

    def label(self) -> str:
        """``triton``, ``c++`` or ``torch: <reason> (<implementation>),
        ...``, as the layer table prints it.
        """
        if self.path == 'torch' and self.refusals:
            return 'torch: ' + ', '.join(f'{reason} ({name})'
                                         for name, reason in self.refusals)
        return self.path


def switch_state() -> tuple:
    """The backend switches and the device stand-in: part of every cache
    key, so a switch changed at run time is seen at once.
    """
    return (switches.values(BACKEND_SWITCHES), triton_runtime.INTERPRETED,
            device_path.acting_as_cuda(), torch.is_autocast_enabled('cpu'))


def tensor_signature(t) -> Optional[tuple]:
    """What a choice may depend on of one tensor (None for None)."""
    if t is None:
        return None
    return (type(t), tuple(t.shape), t.dtype, t.device, t.stride(),
            t.requires_grad)


def _default_signature(*call) -> tuple:
    return tuple(tensor_signature(a) if isinstance(a, torch.Tensor) else a
                 for a in call)


@dataclass
class Operator:
    """An operator's priority list and its cache of choices."""
    name: str
    implementations: List[Implementation] = field(default_factory=list)
    signature: Callable[..., tuple] = _default_signature
    _cache: 'OrderedDict[tuple, Choice]' = field(
        default_factory=OrderedDict, repr=False)
    _hits: int = 0
    _misses: int = 0

    def add(self, implementation: Implementation,
            before: Optional[str] = None) -> None:
        """Insert ``implementation`` before ``before``, else just before the
        reference; forgets the cache.
        """
        names = [impl.name for impl in self.implementations]
        if implementation.name in names:
            raise ValueError(f'{self.name} already has an implementation '
                             f'named {implementation.name!r}: {names}')
        at = names.index(before) if before is not None else max(
            len(names) - 1, 0)
        self.implementations.insert(at, implementation)
        self.cache_clear()

    def remove(self, name: str) -> None:
        self.implementations[:] = [impl for impl in self.implementations
                                   if impl.name != name]
        self.cache_clear()

    def walk(self, *call) -> Choice:
        """The first implementation that takes ``call``, without the cache."""
        refusals = []
        for impl in self.implementations:
            reason = impl.refusal(*call)
            if reason is None:
                launch = () if impl.launch is None else impl.launch(*call)
                return Choice(impl, launch, tuple(refusals))
            refusals.append((impl.name, reason))
        raise RuntimeError(f'no implementation of {self.name} takes this '
                           f'call: {refusals}')

    def choose(self, *call) -> Choice:
        """The implementation that runs ``call``, cached per signature."""
        if torch.compiler.is_compiling():
            return self.walk(*call)
        key = (self.signature(*call), switch_state())
        found = self._cache.get(key)
        if found is not None:
            self._hits += 1
            self._cache.move_to_end(key)
            return found
        self._misses += 1
        found = self.walk(*call)
        self._cache[key] = found
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return found

    def explain(self, *call) -> Explanation:
        """The implementation ``call`` takes and every refusal before it."""
        choice = self.choose(*call)
        return Explanation(self.name, choice.implementation.name,
                           choice.refusals)

    def refusal(self, implementation: str, *call) -> Optional[str]:
        """Why the named implementation may not run ``call``, whatever
        precedes it (for a benchmark or a forced kernel).
        """
        for impl in self.implementations:
            if impl.name == implementation:
                return impl.refusal(*call)
        raise KeyError(f'{self.name} has no implementation named '
                       f'{implementation!r}: '
                       f'{[impl.name for impl in self.implementations]}')

    def cache_info(self) -> dict:
        return dict(hits=self._hits, misses=self._misses,
                    size=len(self._cache), maxsize=CACHE_SIZE)

    def cache_clear(self) -> None:
        self._cache.clear()


_OPERATORS: Dict[str, Operator] = {}


def register(name: str, implementations: List[Implementation],
             signature: Callable[..., tuple] = _default_signature
             ) -> Operator:
    """Declare operator ``name`` with its priority list (reference last)."""
    if name in _OPERATORS:
        raise ValueError(f'operator {name!r} is registered already')
    op = Operator(name, list(implementations), signature)
    _OPERATORS[name] = op
    shape_caches.register(f'dispatch.{name}', CACHE_SIZE,
                          lambda: len(op._cache), clear=op.cache_clear)
    return op


def operator(name: str) -> Operator:
    """The registered operator ``name``."""
    try:
        return _OPERATORS[name]
    except KeyError:
        raise KeyError(f'no operator {name!r}; registered: '
                       f'{sorted(_OPERATORS)}') from None


def choose(name: str, *call) -> Choice:
    """The implementation of operator ``name`` that runs ``call``."""
    return operator(name).choose(*call)


def explain(name: str, *call) -> Explanation:
    """The path operator ``name`` takes for ``call`` and every refusal."""
    return operator(name).explain(*call)


def refusal(name: str, implementation: str, *call) -> Optional[str]:
    """Why the named implementation of ``name`` may not run ``call``, or
    None.
    """
    return operator(name).refusal(implementation, *call)


def misses() -> int:
    """Choices made without the cache so far, every operator's: a steady
    training step makes none."""
    return sum(op._misses for op in _OPERATORS.values())


def cache_info() -> Dict[str, dict]:
    """Every operator's cache statistics."""
    return {name: op.cache_info() for name, op in sorted(_OPERATORS.items())}


def cache_clear() -> None:
    """Forget every operator's cached choices."""
    for op in _OPERATORS.values():
        op.cache_clear()


def compiled_kernels_refusal(name: str = 'patch_ops') -> Optional[str]:
    """Why the compiled extension ``name`` may not run, or None."""
    return availability.native_refusal(name)
