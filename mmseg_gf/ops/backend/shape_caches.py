"""The package's caches keyed on shapes: each bounded, each listed here.

A training run with a random-resize pipeline brings a new input shape with
almost every batch, and every layer sees its own sizes: a cache keyed on
shapes (interpolation matrices, tuned kernel tiles, kept output blocks)
that never forgets grows with the run. Each such cache therefore has a
stated bound (least recently used entries go first) and registers here,
in one line, so that :func:`shape_caches` reports every one of them with
its current size (the soak benchmark, ``tools/soak.py``, prints them at the
end of a run and its test checks them against their bounds).

Registering:

* a function memoised per shape: ``@shape_caches.lru('module.name',
  maxsize)`` in place of ``functools.lru_cache(maxsize)``;
* a dict a library fills (triton's autotuner): replace it by a
  :class:`BoundedDict` and :func:`register` its size;
* anything else: :func:`register` with a function returning its size, in
  entries or bytes.

The bottom layer (``ops``) holds the registry, so every layer may
register. No mmseg import.
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
        bound: the most it holds, in ``unit``s (a function: a bound a
            switch sets is read when asked).
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
    """List a cache under ``name`` (registering a name again replaces its
    entry: a reloaded module). ``bound``: an int or a function returning
    it."""
    if unit not in ('entries', 'bytes'):
        raise ValueError(f'unit of shape cache {name!r} must be "entries" '
                         f'or "bytes", not {unit!r}')
    bound_fn = bound if callable(bound) else (lambda: int(bound))
    cache = ShapeCache(name, bound_fn, size, unit, clear)
    _CACHES[name] = cache
    return cache


def lru(name: str, maxsize: int) -> Callable[[Callable], Callable]:
    """``functools.lru_cache(maxsize)`` that registers the cache under
    ``name``: ``@shape_caches.lru('bilinear_gemm.matrix', 64)``."""
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
    """A dict of at most ``maxsize`` entries, least recently used first
    out: for a cache a library keeps as a plain dict (``key in d``,
    ``d[key]``, ``d[key] = value``)."""

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
    """Every registered cache: ``{name: {'size', 'bound', 'unit'}}``, by
    name."""
    return {name: dict(size=int(c.size()), bound=int(c.bound()),
                       unit=c.unit)
            for name, c in sorted(_CACHES.items())}


def over_bound() -> Dict[str, dict]:
    """The caches holding more than their bound (none, unless one is
    broken): :func:`shape_caches`' entries with ``size > bound``."""
    return {name: c for name, c in shape_caches().items()
            if c['size'] > c['bound']}


def clear_shape_caches() -> None:
    """Empty every cache that can be emptied."""
    for cache in _CACHES.values():
        if cache.clear is not None:
            cache.clear()
