"""The optional compiled CPU extensions (``csrc/``), loaded in one place.

``setup.py`` builds ``mmseg_gf._patch_ops`` (the filtered conv and Linear,
the bilinear backward, the output pool), ``mmseg_gf._bit_mask`` and
``mmseg_gf._resized_loss`` when torch is importable at install time.
Without them, or with ``MMSEG_GF_NATIVE=0`` in the environment, every
operator runs its PyTorch path, which computes the same numbers.
:func:`module` is the extension itself (built, switched on or off: the
output pool lives there either way); whether an operator may call it now
is :func:`.availability.native_refusal`.
"""
import importlib
from types import ModuleType
from typing import Dict, Optional

__all__ = ['NAMES', 'KERNELS', 'module', 'built', 'missing_kernels']

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


def missing_kernels() -> Dict[str, str]:
    """The compiled modules that did not import, each with its error."""
    for name in NAMES:
        module(name)
    return dict(_missing)
