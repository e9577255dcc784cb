"""Whether each backend may run now: the one module that probes them.

The compiled CPU extensions (:mod:`.extension` loads them) run where they
are built and ``MMSEG_GF_NATIVE`` is not ``0``; the Triton kernels where
triton (:data:`.triton_runtime.MIN_TRITON` or newer) is installed,
``MMSEG_GF_TRITON`` is on and the tensor is on CUDA (on the CPU under
triton's interpreter). The implementations' refusals and the dispatcher
(:mod:`.dispatch`) ask these functions; nothing else reads the backend
switches. A missing extension is reported once at import
(:func:`warn_if_kernels_missing`).
"""
import contextlib
import warnings
from typing import Iterator, Optional

from torch import Tensor

from . import extension, switches, triton_runtime

__all__ = ['native_switched_on', 'native_refusal', 'native_available',
           'triton_installed', 'triton_enabled', 'set_triton_enabled',
           'triton_switched',
           'triton_refusal', 'triton_takes', 'KernelsMissingWarning',
           'warn_if_kernels_missing']


def native_switched_on() -> bool:
    """``MMSEG_GF_NATIVE`` not ``0``: the compiled kernels may run."""
    return bool(switches.value('MMSEG_GF_NATIVE'))


def native_refusal(name: str = 'patch_ops') -> Optional[str]:
    """Why the compiled extension ``name`` may not run now, or None."""
    if extension.module(name) is None:
        return f'{extension.NAMES[name]} not built'
    if not native_switched_on():
        return 'MMSEG_GF_NATIVE off'
    return None


def native_available(name: str = 'patch_ops') -> bool:
    """The compiled extension ``name`` is built and switched on."""
    return native_refusal(name) is None


def triton_installed() -> bool:
    """triton is installed, :data:`.triton_runtime.MIN_TRITON` or newer."""
    version = triton_runtime.TRITON_VERSION
    return version is not None and version >= triton_runtime.MIN_TRITON


def triton_enabled() -> bool:
    """triton installed and the Triton paths switched on."""
    return triton_installed() and bool(switches.value('MMSEG_GF_TRITON'))


def set_triton_enabled(flag: Optional[bool]) -> Optional[bool]:
    """Switch the Triton paths on or off for this process (None: back to
    ``MMSEG_GF_TRITON``); returns the previous override."""
    return switches.set_value('MMSEG_GF_TRITON',
                              None if flag is None else bool(flag))


@contextlib.contextmanager
def triton_switched(flag: Optional[bool]) -> Iterator[None]:
    """:func:`set_triton_enabled` inside the block; the previous setting
    comes back afterwards."""
    previous = set_triton_enabled(flag)
    try:
        yield
    finally:
        set_triton_enabled(previous)


def triton_refusal(t: Tensor) -> Optional[str]:
    """Why ``t``'s device may not take a Triton path, or None (each path
    adds its own conditions)."""
    if not triton_installed():
        version = triton_runtime.TRITON_VERSION
        return 'triton not installed' if version is None else (
            f'triton {version} older than {triton_runtime.MIN_TRITON}')
    device = t.device.type
    if not (device == 'cuda' or
            (triton_runtime.INTERPRETED and device == 'cpu')):
        return f'{device} tensor'
    if not switches.value('MMSEG_GF_TRITON'):
        return 'MMSEG_GF_TRITON off'
    return None


def triton_takes(t: Tensor) -> bool:
    """``t``'s device may take a Triton path at all."""
    return triton_refusal(t) is None


class KernelsMissingWarning(UserWarning):
    """The compiled CPU kernels are not built: the PyTorch path runs."""


_warned = False


def warn_if_kernels_missing() -> bool:
    """Warn once per process (:class:`KernelsMissingWarning`) where a
    compiled module is missing, naming the slower path and how to build
    it; silent where the kernels are off on purpose (``MMSEG_GF_NATIVE=0``
    or ``MMSEG_GF_BUILD_NATIVE=0``). Returns whether it warned."""
    global _warned
    missing = extension.missing_kernels()
    if _warned or not missing or not native_switched_on() \
            or not switches.value('MMSEG_GF_BUILD_NATIVE'):
        return False
    _warned = True
    names = ', '.join(f'mmseg_gf.{name} ({extension.KERNELS[name]})'
                      for name in missing)
    warnings.warn(
        f'mmseg_gf: compiled CPU kernels not built: {names}; the slower '
        'pure-PyTorch path runs (same results). Build them where torch is '
        'installed: `pip install --no-build-isolation --no-deps -e .` in '
        'the repository (or `python setup.py build_ext --inplace`). '
        'MMSEG_GF_NATIVE=0 or MMSEG_GF_BUILD_NATIVE=0 silences this. '
        f'Import error: {next(iter(missing.values()))}',
        KernelsMissingWarning, stacklevel=2)
    return True
