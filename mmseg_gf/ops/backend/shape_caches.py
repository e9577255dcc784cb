"""The package's caches keyed on shapes: each bounded, each listed here.

A random-resize pipeline brings a new shape with almost every batch, so
every shape-keyed cache states a bound (LRU) and registers here, and
:func:`shape_caches` reports them all (docs/reliability.md, "Long runs
with a new input size in every batch"). Register a memoised function with
``@shape_caches.lru(name, maxsize)``, a library's dict as a
:class:`BoundedDict` plus :func:`register`, anything else with
:func:`register` and a size function. No mmseg import.
"""
import collections
import functools
from dataclasses import dataclass
from typing import Callable, Dict, Optional

__all__ = ['ShapeCache', 'BoundedDict', 'register', 'lru', 'shape_caches',
           'clear_shape_caches', 'over_bound']


@dataclass(frozen=True)
class ShapeCache:
    """One registered cache.

    Attributes:
        name: ``'module.cache'``, unique.
        bound: the most it holds in ``unit``s (or a function giving it).
        size: its size now, in ``unit``s.
        unit: ``'entries'`` or ``'bytes'``.
        clear: empties it (None: it cannot be emptied from here).
    """

    name: str
    bound: Callable[[], int]
    size: Callable[[], int]
    unit: str = 'entries'
    clear: Optional[Callable[[], None]] = None


_CACHES: Dict[str, ShapeCache] = {}


def register(name: str, bound, size: Callable[[], int],
             unit: str = 'entries',
             clear: Optional[Callable[[], None]] = None) -> ShapeCache:
    """List a cache under ``name`` (again: replaces the entry)."""
    if unit not in ('entries', 'bytes'):
        raise ValueError(f'unit of shape cache {name!r} must be "entries" '
                         f'or "bytes", not {unit!r}')
    bound_fn = bound if callable(bound) else (lambda: int(bound))
    cache = ShapeCache(name, bound_fn, size, unit, clear)
    _CACHES[name] = cache
    return cache


def lru(name: str, maxsize: int) -> Callable[[Callable], Callable]:
    """``functools.lru_cache(maxsize)`` registered under ``name``."""
    if not isinstance(maxsize, int) or maxsize <= 0:
        raise ValueError(f'shape cache {name!r} needs a positive int '
                         f'maxsize, not {maxsize!r}')

    def wrap(fn: Callable) -> Callable:
        cached = functools.lru_cache(maxsize=maxsize)(fn)
        register(name, maxsize, lambda: cached.cache_info().currsize,
                 clear=cached.cache_clear)
        return cached

    return wrap


class BoundedDict(collections.OrderedDict):
    """A dict of at most ``maxsize`` entries, least recently used first out."""

    def __init__(self, maxsize: int, *args, **kwargs) -> None:
        self.maxsize = int(maxsize)
        super().__init__(*args, **kwargs)
        self._trim()

    def __getitem__(self, key):
        value = super().__getitem__(key)
        self.move_to_end(key)
        return value

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        self._trim()

    def _trim(self) -> None:
        while len(self) > self.maxsize:
            self.popitem(last=False)


def shape_caches() -> Dict[str, dict]:
    """Every registered cache: ``{name: {'size', 'bound', 'unit'}}``."""
    return {name: dict(size=int(c.size()), bound=int(c.bound()),
                       unit=c.unit)
            for name, c in sorted(_CACHES.items())}


def over_bound() -> Dict[str, dict]:
    """The caches holding more than their bound (none unless one is broken)."""
    return {name: c for name, c in shape_caches().items()
            if c['size'] > c['bound']}


def clear_shape_caches() -> None:
    for cache in _CACHES.values():
        if cache.clear is not None:
            cache.clear()
