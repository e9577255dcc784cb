"""mmseg_gf.engine.scope: the ``mmseg_gf`` config scope (``_base_ =
'mmseg_gf::...'``) as entries in mmengine's table and mmseg's registries,
each undone by ``uninstall``. Resolving a ``mmseg_gf::`` base from an
installed wheel: tests/test_packaging.py."""
import importlib
import os

import pytest

pytest.importorskip('mmseg')

from mmengine.config import utils as config_utils  # noqa: E402
from mmengine.registry import MODELS as ROOT_MODELS  # noqa: E402
from mmengine.utils import get_installed_path, is_installed  # noqa: E402
from mmseg import registry as mmseg_registry  # noqa: E402

import mmseg_gf  # noqa: E402

from mmseg_gf.engine import scope  # noqa: E402
from mmseg_gf.models import GFConv2d  # noqa: E402


@pytest.fixture
def uninstalled():
    """The scope removed for the test, installed again after it."""
    scope.uninstall()
    try:
        yield
    finally:
        scope.install()


def test_importing_the_package_installs_the_scope():
    assert scope.installed()
    assert config_utils.MODULE2PACKAGE['mmseg_gf'] == 'mmseg_gf.registry'
    for name in mmseg_registry.__all__:
        parent = getattr(mmseg_registry, name)
        child = parent.children['mmseg_gf']
        assert child is scope.REGISTRIES[name] and child.parent is parent
        assert child._module_dict == {}  # every lookup falls through


def test_mmengine_imports_the_scopes_registries_by_its_name():
    registry = importlib.import_module('mmseg_gf.registry')
    assert registry.MODELS is scope.REGISTRIES['MODELS']


def test_mmengine_finds_the_imported_package_for_the_scope():
    """Whatever distribution is installed (an editable install's metadata
    lies elsewhere): the directory of the package imported here."""
    package = config_utils.MODULE2PACKAGE['mmseg_gf']
    assert is_installed(package)
    assert get_installed_path(package) == os.path.dirname(mmseg_gf.__file__)


def test_an_object_of_the_scope_builds_from_mmsegs_registries():
    conv = ROOT_MODELS.build(dict(type='GFConv2d', _scope_='mmseg_gf',
                                  in_channels=2, out_channels=3,
                                  kernel_size=3, radius=2))
    assert isinstance(conv, GFConv2d)
    seg_cls = scope.REGISTRIES['MODELS'].get('EncoderDecoder')
    assert seg_cls is mmseg_registry.MODELS.get('EncoderDecoder')


def test_uninstall_leaves_mmengine_and_mmseg_as_they_were(uninstalled):
    assert not scope.installed()
    assert 'mmseg_gf' not in config_utils.MODULE2PACKAGE
    assert all('mmseg_gf' not in getattr(mmseg_registry, name).children
               for name in mmseg_registry.__all__)
    assert all(r.parent is None for r in scope.REGISTRIES.values())
    scope.install()
    scope.install()  # a no-op when installed
    assert scope.installed() and len(scope._undos) == 1 + len(
        mmseg_registry.__all__)
