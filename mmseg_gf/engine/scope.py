"""The ``mmseg_gf`` config scope: ``_base_ = 'mmseg_gf::gf/...py'``.

mmengine reads a ``<package>::<path>`` base from the package's
``.mim/configs`` only for a package named in its ``MODULE2PACKAGE`` table,
and builds that base's objects from the registries of scope
``<package>``. :func:`install` (run when :mod:`mmseg_gf.engine` is
imported) adds the table's entry (``mmseg_gf.registry``: the imported
package's directory whatever the install) and, under each of mmseg's
registries, an empty child registry of scope ``mmseg_gf`` whose lookups
fall through to mmseg's, so a config inheriting from ``mmseg_gf::`` builds
exactly what the repository's file builds. Both changes go through
:mod:`mmseg_gf.patching` (docs/patching.md, "Dict entries");
:func:`uninstall` undoes them."""
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
    """A registry of scope ``mmseg_gf`` for ``parent``: its lazy imports
    are the parent's and this package (a registry of a scope in
    ``MODULE2PACKAGE`` without locations would look for
    ``mmseg_gf.utils.register_all_modules``)."""
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
    """Add ``mmseg_gf`` to mmengine's ``MODULE2PACKAGE`` and each of
    :data:`REGISTRIES` under its mmseg parent; a no-op when installed."""
    if _undos:
        return
    _undos.append(patching.set_entry(config_utils.MODULE2PACKAGE, SCOPE,
                                     PACKAGE_LOOKUP))
    for name, child in REGISTRIES.items():
        parent = getattr(mmseg_registry, name)
        child.parent = parent
        _undos.append(patching.set_entry(parent._children, SCOPE, child))


def uninstall() -> None:
    """Undo :func:`install`: mmengine's table and mmseg's registries as
    they were (the child registries stay, detached)."""
    while _undos:
        _undos.pop()()
    for child in REGISTRIES.values():
        child.parent = None
