"""The package carries itself: the sdist holds every C++ source of the
kernels, configs/ and tools/; a wheel built from that sdist (without
isolation, against the torch installed here) holds the three compiled
kernels and ships configs/ and tools/ under ``mmseg_gf/.mim``, and once
installed it imports with its kernels and resolves ``mmseg_gf::`` configs.

One sdist and one wheel for the module (the wheel compiles the kernels:
about 1-2 minutes on 2 cores, ``MAX_JOBS=2``); deselect with
``-m "not packaging"``."""
import os
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

pytest.importorskip('torch.utils.cpp_extension')
pytest.importorskip('setuptools')

pytestmark = pytest.mark.packaging

REPO = Path(__file__).resolve().parents[1]
KERNELS = ('_patch_ops', '_bit_mask', '_resized_loss')


def _files(root: str, pattern: str):
    """``root``'s files matching ``pattern``, relative to the repository."""
    return sorted(str(p.relative_to(REPO)) for p in (REPO / root).rglob(
        pattern) if p.is_file() and '__pycache__' not in p.parts)


@pytest.fixture(scope='module')
def built(tmp_path_factory):
    """``(sdist, wheel)`` paths: the sdist built by setuptools' PEP 517
    hook from the checkout, the wheel by pip from that sdist, both without
    isolation."""
    out = tmp_path_factory.mktemp('dist')
    env = dict(os.environ, MAX_JOBS='2')
    env.pop('MMSEG_GF_BUILD_NATIVE', None)
    subprocess.run([sys.executable, '-c',
                    'import sys; from setuptools import build_meta; '
                    'build_meta.build_sdist(sys.argv[1])', str(out)],
                   cwd=REPO, env=env, check=True, capture_output=True)
    sdist, = out.glob('*.tar.gz')
    subprocess.run([sys.executable, '-m', 'pip', 'wheel', '-q',
                    '--no-build-isolation', '--no-deps', '-w', str(out),
                    str(sdist)], cwd=out, env=env, check=True)
    wheel, = out.glob('*.whl')
    return sdist, wheel


def test_the_sdist_holds_every_kernel_source_and_the_configs_and_tools(
        built):
    sdist, _ = built
    with tarfile.open(sdist) as tar:
        names = {n.split('/', 1)[1] for n in tar.getnames() if '/' in n}
    sources = _files('mmseg_gf/ops/csrc', '*')
    assert sources and any(s.endswith('.h') for s in sources)
    wanted = sources + _files('configs', '*.py') + _files('tools', '*.py') + [
        'setup.py', 'pyproject.toml', 'MANIFEST.in', 'model-index.yml']
    assert sorted(set(wanted) - names) == []
    assert not any('.mim' in n or n.endswith('.so') for n in names)


def test_the_wheel_holds_the_kernels_the_configs_and_the_tools(built):
    _, wheel = built
    assert not wheel.name.endswith('-none-any.whl')  # it holds binaries
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
    for kernel in KERNELS:
        assert any(n.startswith(f'mmseg_gf/{kernel}.') and n.endswith('.so')
                   for n in names), kernel
    shipped = ['mmseg_gf/.mim/' + f
               for f in _files('configs', '*.py') + _files('tools', '*.py')]
    assert sorted(set(shipped) - names) == []
    assert 'mmseg_gf/.mim/model-index.yml' in names
    assert not any(n.startswith('mmseg_gf/.mim/') and '__pycache__' in n
                   for n in names)


INSTALLED_CHECK = textwrap.dedent('''
    import sys
    import mmseg_gf
    from mmseg_gf.ops.backend import extension
    assert mmseg_gf.__file__.startswith(sys.argv[1]), mmseg_gf.__file__
    assert extension.missing_kernels() == {}, extension.missing_kernels()
    from mmengine.config import Config
    from mmseg.registry import MODELS
    from mmseg.utils import register_all_modules
    register_all_modules(init_default_scope=True)
    path, scope = Config._get_cfg_path('mmseg_gf::gf/pspnet_r18_voc_r4.py', '')
    cfg = Config.fromfile(sys.argv[2])
    assert cfg.gradient_filter.radius == 4, cfg.gradient_filter
    model = MODELS.build(cfg.model)
    print(type(model).__name__, scope, path)
''')


def test_the_installed_wheel_imports_its_kernels_and_configs(
        built, tmp_path):
    """Installed in a fresh venv that sees the stack installed here but no
    checkout: ``mmseg_gf::`` configs resolve to the installed copies."""
    _, wheel = built
    venv = tmp_path / 'venv'
    subprocess.run([sys.executable, '-m', 'venv', '--without-pip',
                    str(venv)], check=True)
    python = venv / 'bin' / 'python'
    site = subprocess.run(
        [str(python), '-c', 'import sysconfig; '
         'print(sysconfig.get_paths()["purelib"])'],
        check=True, capture_output=True, text=True).stdout.strip()
    # The stack's directories as plain paths (their .pth files unread: an
    # editable checkout of this package stays out of sight).
    stack = {sysconfig.get_paths()[k] for k in ('purelib', 'platlib')}
    Path(site, 'stack.pth').write_text('\n'.join(sorted(stack)) + '\n')
    subprocess.run([sys.executable, '-m', 'pip', 'install', '-q',
                    '--no-deps', '--target', site, str(wheel)], check=True)
    config = tmp_path / 'mine.py'
    config.write_text("_base_ = 'mmseg_gf::gf/pspnet_r18_voc_r4.py'\n"
                      "model = dict(pretrained=None)\n")
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
    out = subprocess.run([str(python), '-c', INSTALLED_CHECK, site,
                          str(config)], cwd=tmp_path, env=env, check=True,
                         capture_output=True, text=True).stdout
    # the installed package's copy of the config, and mmseg's segmentor
    name, scope, path = out.split()
    assert (name, scope) == ('EncoderDecoder', 'mmseg_gf'), out
    assert path == f'{site}/mmseg_gf/.mim/configs/gf/pspnet_r18_voc_r4.py'
