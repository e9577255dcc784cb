"""Where the compiled CPU kernels are missing, importing mmseg_gf warns
once, naming the slower path and how to build them; silent where they are
off on purpose (``MMSEG_GF_NATIVE=0``, ``MMSEG_GF_BUILD_NATIVE=0``)."""
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from mmseg_gf.ops.backend import availability, extension, switches

REPO = Path(__file__).resolve().parents[3]
MISSING = {name: f'No module named mmseg_gf.{name}' for name in extension.KERNELS}


@pytest.fixture
def none_built(monkeypatch):
    """The loaders' record as where no kernel was built, not warned yet."""
    monkeypatch.setattr(extension, '_missing', dict(MISSING))
    monkeypatch.setattr(availability, '_warned', False)


def test_the_warning_names_every_module_the_path_and_the_build(none_built):
    with pytest.warns(availability.KernelsMissingWarning) as caught:
        assert availability.warn_if_kernels_missing()
    text = str(caught[0].message)
    assert all(f'mmseg_gf.{name}' in text for name in extension.KERNELS)
    assert 'pure-PyTorch path' in text
    assert 'pip install --no-build-isolation' in text
    assert 'python setup.py build_ext --inplace' in text


def test_the_warning_comes_once(none_built):
    with pytest.warns(availability.KernelsMissingWarning):
        availability.warn_if_kernels_missing()
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert not availability.warn_if_kernels_missing()


@pytest.mark.parametrize('switch', ['MMSEG_GF_NATIVE',
                                    'MMSEG_GF_BUILD_NATIVE'])
def test_no_warning_where_the_kernels_are_off_on_purpose(none_built, switch):
    with switches.override(**{switch: False}), warnings.catch_warnings():
        warnings.simplefilter('error')
        assert not availability.warn_if_kernels_missing()


def test_no_warning_where_every_kernel_imported(monkeypatch):
    monkeypatch.setattr(extension, '_missing', {})
    monkeypatch.setattr(availability, '_warned', False)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert not availability.warn_if_kernels_missing()


def _import_copy(tmp_path, **env):
    """Import a copy of the package without its compiled modules in a
    fresh process; returns its stderr."""
    shutil.copytree(REPO / 'mmseg_gf', tmp_path / 'mmseg_gf',
                    ignore=shutil.ignore_patterns('*.so', '__pycache__',
                                                  '.mim'))
    environ = dict(os.environ, PYTHONPATH=str(tmp_path), **env)
    code = ('import mmseg_gf; from mmseg_gf.ops.backend import extension; '
            'assert mmseg_gf.__file__.startswith(%r); '
            'assert sorted(extension.missing_kernels()) == %r' %
            (str(tmp_path), sorted(extension.KERNELS)))
    return subprocess.run([sys.executable, '-W', 'always', '-c', code],
                          env=environ, cwd=tmp_path, capture_output=True,
                          text=True, check=True).stderr


def test_a_package_without_its_kernels_warns_at_import(tmp_path):
    stderr = _import_copy(tmp_path)
    assert stderr.count('KernelsMissingWarning') == 1, stderr
    assert 'compiled CPU kernels not built' in stderr


def test_a_package_built_without_kernels_on_purpose_is_silent(tmp_path):
    stderr = _import_copy(tmp_path, MMSEG_GF_BUILD_NATIVE='0')
    assert 'KernelsMissingWarning' not in stderr, stderr
