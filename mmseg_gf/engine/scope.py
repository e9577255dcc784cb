"""The ``mmseg_gf`` config scope: ``_base_ = 'mmseg_gf::gf/...py'``.

mmengine reads a ``<package>::<path>`` base from the installed package's
``.mim/configs`` (setup.py ships the repository's ``configs/`` there) only
for a package named in its ``MODULE2PACKAGE`` table, and marks every
object of that base with ``_scope_='<package>'``: building one switches to
the registries of that scope, imported from ``<package>.registry``. So
:func:`install` (run when :mod:`mmseg_gf.engine` is imported) adds the
table's entry and, under each of mmseg's registries, a child registry of
scope ``mmseg_gf`` that holds nothing of its own: every lookup falls through
to mmseg's registry (where the package registers its modules and hooks),
so a config inheriting from ``mmseg_gf::`` builds exactly what the same
config built from the repository's file does. ``mmseg_gf/registry.py``
re-exports these registries under the name mmengine imports.

The table entry maps ``mmseg_gf`` to ``mmseg_gf.registry``: mmengine looks
that name up as a distribution first (there is none of that name) and
then as a module, taking the directory of the module it finds. That is
the imported package's directory whatever the install (a wheel, an
editable install, a checkout on ``PYTHONPATH``), where the distribution's
own name would send mmengine to where the distribution's metadata lies:
``site-packages`` for an editable install, or an older install's location.

Both changes go through :mod:`mmseg_gf.patching` (docs/patching.md);
:func:`uninstall` undoes them.
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
