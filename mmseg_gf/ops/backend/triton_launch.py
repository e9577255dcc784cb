"""What every Triton kernel of mmseg_gf shares: the accumulation dtype,
the launch options, the autotuner's timing and its on/off state
(:class:`Tuning`), and the patches of an axis.

Importing this module imports ``triton``: only the kernels' modules import
it, and they are loaded on first GPU-path use.
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
    """The accumulation dtype of a kernel over ``dtype`` tensors: float64
    for float64, float32 otherwise."""
    return tl.float64 if dtype == torch.float64 else tl.float32


# Rounding as written, no fused multiply-adds (also what triton 3.10 will
# default to; saying so silences 3.9's warning about the change).
LAUNCH_OPTIONS = dict(enable_fp_fusion=False)


def timed_by_default(fn: Callable, quantiles=None):
    """How ``triton.autotune`` times a config here: triton's ``do_bench``
    with 5 ms of warm-up and 20 ms of repeats (its defaults, 25 and 100,
    would take seconds in a first step of many layer shapes)."""
    return triton.testing.do_bench(fn, warmup=5, rep=20,
                                   quantiles=quantiles)


class Tuning:
    """A kernel's ``triton.autotune`` wrapper, built on first use by
    ``build(configs=None, do_bench=None)``, and whether launches take it.

    On a GPU they do unless ``MMSEG_GF_AUTOTUNE=0`` or the installed
    triton's ``autotune`` refuses the arguments (then the kernel with the
    caller's fixed meta-parameters); under triton's interpreter they
    do not (timing interpreted runs would slow the tests and choose
    nothing a GPU would), except inside :meth:`using`: how the tests run
    the autotuner, timed by the wall clock.

    The autotuner keeps one choice per key (the kernel's shape arguments:
    one per layer and input size); here at most :data:`TUNED_KEYS`, least
    recently used first out, listed as shape cache ``name`` (when
    given)."""

    def __init__(self, build: Callable, name: Optional[str] = None) -> None:
        self.build = build
        self._tuner = None
        self._override: List = []
        if name is not None:
            shape_caches.register(name, TUNED_KEYS, self.tuned_keys,
                                  clear=self.forget)

    def tuned_keys(self) -> int:
        """How many tuned choices the built autotuner keeps."""
        return len(getattr(self._tuner, 'cache', None) or ())

    def forget(self) -> None:
        """Drop the tuned choices (the next launch of a shape tunes
        again)."""
        cache = getattr(self._tuner, 'cache', None)
        if cache is not None:
            cache.clear()

    def tuner(self):
        """The autotuned launcher to take now, or None (fixed
        meta-parameters)."""
        if self._override:
            return self._override[-1]
        if switches.value('TRITON_INTERPRET') or \
                not switches.value('MMSEG_GF_AUTOTUNE'):
            return None
        if self._tuner is None:
            try:
                self._tuner = _bounded(self.build())
            except TypeError:  # a triton whose autotune takes no do_bench
                self._tuner = False
        return self._tuner or None

    @contextlib.contextmanager
    def using(self, tuner):
        """Launches take ``tuner`` (one of :attr:`build`'s) inside the
        block."""
        self._override.append(tuner)
        try:
            yield tuner
        finally:
            self._override.pop()


#: Tuned choices an autotuner keeps (:class:`Tuning`).
TUNED_KEYS = 256


def _bounded(tuner):
    """``tuner`` (a ``triton.autotune`` wrapper) keeping at most
    :data:`TUNED_KEYS` choices: its ``cache`` dict made a
    :class:`~.shape_caches.BoundedDict`."""
    if isinstance(getattr(tuner, 'cache', None), dict):
        tuner.cache = shape_caches.BoundedDict(TUNED_KEYS, tuner.cache)
    return tuner


def radius_patches(size: int, radius: int) -> Patches:
    """The ``r``-element patches tiling an axis of ``size`` from 0 (the
    last one may be short: the kernels clip it to the map)."""
    return 0, radius, -(-size // radius)
