"""The optional compiled CPU extensions (``csrc/``), loaded in one place.

``setup.py`` builds ``mmseg_gf._patch_ops`` (the filtered conv and Linear,
the bilinear backward, the output pool), ``mmseg_gf._bit_mask`` and
``mmseg_gf._resized_loss`` when torch is importable at install time.
Without them, or with ``MMSEG_GF_NATIVE=0`` in the environment, every
operator runs its PyTorch path, which computes the same numbers.
:func:`module` is the extension itself (built, switched on or off: the
output pool lives there either way); :func:`refusal` says why an operator
may not call it now. Where one is missing, :func:`warn_if_kernels_missing`
warns once per process (the package's import calls it).
"""
import importlib
import warnings
from types import ModuleType
from typing import Dict, Optional

from . import switches

__all__ = ['NAMES', 'KERNELS', 'KernelsMissingWarning', 'module', 'built',
           'switched_on', 'refusal', 'available', 'missing_kernels',
           'warn_if_kernels_missing']

#: The compiled extensions ``setup.py`` builds, by the name the operators
#: use.
NAMES = {'patch_ops': 'mmseg_gf._patch_ops', 'bit_mask': 'mmseg_gf._bit_mask',
         'resized_loss': 'mmseg_gf._resized_loss'}
#: The compiled modules, each with what it makes faster.
KERNELS = {
    '_patch_ops': 'the filtered convs and Linears',
    '_bit_mask': "the lean region's bit masks",
    '_resized_loss': 'the loss on upsampled logits',
}

_loaded: Dict[str, Optional[ModuleType]] = {}
#: module name (a key of KERNELS) -> why it did not import
_missing: Dict[str, str] = {}
_warned = False


class KernelsMissingWarning(UserWarning):
    """The compiled CPU kernels are not built: the PyTorch path runs."""


def module(name: str) -> Optional[ModuleType]:
    """The built extension ``name`` (a key of :data:`NAMES`), imported once,
    or None if it is not built."""
    if name not in _loaded:
        try:
            _loaded[name] = importlib.import_module(NAMES[name])
        except ImportError as error:  # not built: the PyTorch paths
            _loaded[name] = None
            _missing[NAMES[name].rpartition('.')[2]] = str(error)
    return _loaded[name]


def built(name: str = 'patch_ops') -> bool:
    """True if the extension ``name`` is built (switched off or not)."""
    return module(name) is not None


def switched_on() -> bool:
    """Whether the compiled kernels may run: ``MMSEG_GF_NATIVE`` not ``0``
    (the one place that reads it)."""
    return bool(switches.value('MMSEG_GF_NATIVE'))


def refusal(name: str = 'patch_ops') -> Optional[str]:
    """Why the extension ``name`` may not run now, or None."""
    if module(name) is None:
        return f'{NAMES[name]} not built'
    if not switched_on():
        return 'MMSEG_GF_NATIVE off'
    return None


def available(name: str = 'patch_ops') -> bool:
    """True if the extension ``name`` is built and not switched off."""
    return refusal(name) is None


def missing_kernels() -> Dict[str, str]:
    """The compiled modules that did not import, each with its error."""
    for name in NAMES:
        module(name)
    return dict(_missing)


def warn_if_kernels_missing() -> bool:
    """Warn once per process (:class:`KernelsMissingWarning`) where a
    compiled module is missing, naming the slower path and how to build
    it; silent where the kernels are off on purpose (``MMSEG_GF_NATIVE=0``
    or ``MMSEG_GF_BUILD_NATIVE=0``). Returns whether it warned."""
    global _warned
    missing = missing_kernels()
    if _warned or not missing or not switched_on() \
            or not switches.value('MMSEG_GF_BUILD_NATIVE'):
        return False
    _warned = True
    names = ', '.join(f'mmseg_gf.{name} ({KERNELS[name]})'
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
