"""What every Triton kernel of mmseg_gf shares: the accumulation dtype, the
autotuner (:class:`Tuning`) and the patches of an axis. Imports
``triton``.
"""
import contextlib
from typing import Callable, List, Optional, Tuple

import torch
import triton
import triton.language as tl
import triton.testing

from . import shape_caches, switches

__all__ = ['Patches', 'acc', 'LAUNCH_OPTIONS', 'timed_by_default', 'Tuning',
           'radius_patches', 'TUNED_KEYS']

Patches = Tuple[int, int, int]  # (start, size, count) along one axis


def acc(dtype: torch.dtype):
    """The accumulation dtype: float64 for float64, else float32."""
    return tl.float64 if dtype == torch.float64 else tl.float32


# Rounding as written, no fused multiply-adds (also what triton 3.10 will
# default to; saying so silences 3.9's warning about the change).
LAUNCH_OPTIONS = dict(enable_fp_fusion=False)


def timed_by_default(fn: Callable, quantiles=None):
    """``do_bench`` with 5 ms warm-up and 20 ms repeats (the defaults take
    seconds in a first step of many layer shapes).
    """
    return triton.testing.do_bench(fn, warmup=5, rep=20,
                                   quantiles=quantiles)


#: What :meth:`Tuning.tuner` reads at every launch, as one kept tuple.
_TUNING_SWITCHES = ('TRITON_INTERPRET', 'MMSEG_GF_AUTOTUNE')


class Tuning:
    """A kernel's ``triton.autotune`` wrapper, built on first use, and whether
    launches take it.

    On a GPU unless ``MMSEG_GF_AUTOTUNE=0`` or triton refuses the arguments;
    under the interpreter only inside :meth:`using` (tests). Keeps at most
    :data:`TUNED_KEYS` choices, LRU, registered as shape cache ``name``.
    """

    def __init__(self, build: Callable, name: Optional[str] = None) -> None:
        self.build = build
        self._tuner = None
        self._override: List = []
        if name is not None:
            shape_caches.register(name, TUNED_KEYS, self.tuned_keys,
                                  clear=self.forget)

    def tuned_keys(self) -> int:
        return len(getattr(self._tuner, 'cache', None) or ())

    def forget(self) -> None:
        """Drop the tuned choices (the next launch tunes again)."""
        cache = getattr(self._tuner, 'cache', None)
        if cache is not None:
            cache.clear()

    def tuner(self):
        """The autotuned launcher to take now, or None (fixed tiles)."""
        if self._override:
            return self._override[-1]
        interpreted, autotune = switches.values(_TUNING_SWITCHES)
        if interpreted or not autotune:
            return None
        if self._tuner is None:
            try:
                self._tuner = _bounded(self.build())
            except TypeError:  # a triton whose autotune takes no do_bench
                self._tuner = False
        return self._tuner or None

    @contextlib.contextmanager
    def using(self, tuner):
        """Launches take ``tuner`` inside the block."""
        self._override.append(tuner)
        try:
            yield tuner
        finally:
            self._override.pop()


#: Tuned choices an autotuner keeps (:class:`Tuning`).
TUNED_KEYS = 256


def _bounded(tuner):
    """``tuner`` with its ``cache`` bounded to :data:`TUNED_KEYS`."""
    if isinstance(getattr(tuner, 'cache', None), dict):
        tuner.cache = shape_caches.BoundedDict(TUNED_KEYS, tuner.cache)
    return tuner


def radius_patches(size: int, radius: int) -> Patches:
    """The ``r``-element patches tiling an axis from 0 (the last may be
    short).
    """
    return 0, radius, -(-size // radius)
