"""The ``mmseg_gf`` config scope: ``_base_ = 'mmseg_gf::gf/...py'``.

:func:`install` adds ``mmseg_gf`` to mmengine's ``MODULE2PACKAGE`` and,
under each mmseg registry, a child of scope ``mmseg_gf`` that falls
through to mmseg's, so such a config builds exactly what the file builds;
through :mod:`mmseg_gf.patching` (docs/patching.md, "Dict entries").
"""
from typing import Dict, List

from mmengine.config import utils as config_utils
from mmengine.registry import Registry
from mmseg import registry as mmseg_registry

from .. import patching

__all__ = ['SCOPE', 'PACKAGE_LOOKUP', 'REGISTRIES', 'install', 'uninstall', 'installed']

#: The scope (and ``<package>::`` prefix) of this package's configs.
SCOPE = 'mmseg_gf'
#: What mmengine's ``MODULE2PACKAGE`` maps the scope to: a module of the
#: package that no distribution is named after (see above).
PACKAGE_LOOKUP = 'mmseg_gf.registry'



def _child(parent: Registry) -> Registry:
    """A registry of scope ``mmseg_gf`` for ``parent``, with the parent's lazy
    imports."""
    return Registry(parent.name, scope=SCOPE,
                    locations=list(parent._locations) + ['mmseg_gf.engine'])


#: Name -> child registry of scope ``mmseg_gf`` under mmseg's registry of
#: that name, one per registry mmseg declares.
REGISTRIES: Dict[str, Registry] = {
    name: _child(getattr(mmseg_registry, name))
    for name in mmseg_registry.__all__
}

_undos: List[patching.Entry] = []


def installed() -> bool:
    """Whether :func:`install` is in force."""
    return bool(_undos)


def install() -> None:
    """Add the scope to mmengine's table and mmseg's registries; idempotent."""
    if _undos:
        return
    _undos.append(patching.set_entry(config_utils.MODULE2PACKAGE, SCOPE,
                                     PACKAGE_LOOKUP))
    for name, child in REGISTRIES.items():
        parent = getattr(mmseg_registry, name)
        child.parent = parent
        _undos.append(patching.set_entry(parent._children, SCOPE, child))


def uninstall() -> None:
    """Undo :func:`install` (the child registries stay, detached)."""
    while _undos:
        _undos.pop()()
    for child in REGISTRIES.values():
        child.parent = None
