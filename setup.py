"""Build mmseg_gf: the package, its CPU kernels, and its configs and tools
under ``mmseg_gf/.mim`` (the metadata is in ``pyproject.toml``).

The optional CPU kernels ``mmseg_gf._patch_ops`` (patch sums, spreading,
the fused backward, the filtered Linear's backward on token grids),
``mmseg_gf._bit_mask`` (activation bit masks of the lean trained region)
and ``mmseg_gf._resized_loss`` (the cross-entropy of upsampled logits
without the upsampled logits) are compiled against the torch of the build
environment, which must be the torch that runs them: build without
isolation, in an environment that holds torch (``pip install
--no-build-isolation -e .``, ``pip wheel --no-build-isolation --no-deps
.``). An isolated build has no torch; it stops with a message saying so
rather than give a wheel without kernels. ``MMSEG_GF_BUILD_NATIVE=0``
skips the kernels (a pure-Python wheel; the pure-PyTorch path runs: same
results, slower on CPU).

``configs/``, ``tools/`` and ``model-index.yml`` ship as OpenMMLab
packages ship theirs: under ``mmseg_gf/.mim``, copied into a built wheel,
linked from the checkout by an editable install, so that
``_base_ = 'mmseg_gf::gf/pspnet_r18_voc_r4.py'`` resolves wherever the
package is installed.

The build switches (``MMSEG_GF_BUILD_NATIVE``, ``MMSEG_GF_UNITY_BUILD``)
are declared with the package's others in ``mmseg_gf/ops/backend/switches.py``
(docs/switches.md); this file reads them from the environment itself, since
it runs before the package and torch can be imported.
"""
import os
import os.path as osp
import shutil

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.command.develop import develop

ROOT = osp.dirname(osp.abspath(__file__))
#: What ``mmseg_gf/.mim`` holds, as mmseg's ``add_mim_extension`` ships.
MIM_FILES = ('configs', 'tools', 'model-index.yml')
MIM_DIR = osp.join('mmseg_gf', '.mim')
CSRC = 'mmseg_gf/ops/csrc/'
PATCH_OPS = ('patch_kernels', 'output_recycler', 'cpu_dispatch',
             'collapsed_backward', 'filtered_conv_node', 'bilinear_backward',
             'token_grid_backward', 'token_rows_avx512')
NO_TORCH = (
    'mmseg_gf: torch is not importable in this build environment, so its '
    'CPU kernels cannot be compiled against the torch that will run them. '
    'Build without isolation in an environment that holds torch '
    '(`pip install --no-build-isolation .`, `pip wheel --no-build-isolation '
    '--no-deps .`, `python -m build --no-isolation`), or set '
    'MMSEG_GF_BUILD_NATIVE=0 for a wheel without the kernels (the slower '
    'pure-PyTorch path).')


def kernel_sources():
    """``(name, sources, depends, extra compile args)`` of each kernel."""
    files = [CSRC + name + '.cpp' for name in PATCH_OPS + ('bindings', )]
    # One translation unit (patch_ops_unity.cpp includes the files): torch's
    # headers parsed once, not nine times. MMSEG_GF_UNITY_BUILD=0: one by
    # one, for quicker rebuilds after editing one file.
    unity = os.environ.get('MMSEG_GF_UNITY_BUILD', '1') != '0'
    return [
        # The headers (and the included files) too: `build_ext` rebuilds
        # only when a listed file is newer than the module.
        ('mmseg_gf._patch_ops',
         [CSRC + 'patch_ops_unity.cpp'] if unity else files,
         [CSRC + name + '.h' for name in PATCH_OPS] +
         (files if unity else []), []),
        ('mmseg_gf._bit_mask', [CSRC + 'bit_mask.cpp'], [], []),
        # -fno-trapping-math: the softmax's clamped exp vectorises.
        ('mmseg_gf._resized_loss', [CSRC + 'resized_loss.cpp'], [],
         ['-fno-trapping-math']),
    ]


class NoTorchBuildExt(build_ext):
    """``build_ext`` where torch is not importable: stops the build with
    :data:`NO_TORCH` (an isolated build would otherwise give a wheel that
    silently lacks its kernels)."""

    def run(self):
        raise SystemExit(NO_TORCH)


def native_extension():
    """``(ext_modules, build_ext class)`` for the optional CPU kernels."""
    if os.environ.get('MMSEG_GF_BUILD_NATIVE', '1') == '0':
        return [], build_ext
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        # Declared all the same, so that a wheel build reaches build_ext
        # and says why it cannot go on (an sdist needs no torch).
        return [Extension(name, sources)
                for name, sources, _, _ in kernel_sources()], NoTorchBuildExt
    # OpenMP: at::parallel_for splits the work over threads only when the
    # extension itself is compiled with it. -g0: no debug information (the
    # interpreter's own flags ask for it), which took 40% of a file's
    # compile time and made the modules 40x larger; the code is the same.
    compile_args = ['-O3', '-g0', '-fopenmp']
    exts = [
        CppExtension(name, sources, depends=depends,
                     extra_compile_args=compile_args + extra,
                     extra_link_args=['-fopenmp'])
        for name, sources, depends, extra in kernel_sources()
    ]
    return exts, BuildExtension.with_options(use_ninja=True)


def place_mim(target_root: str, link: bool) -> None:
    """Put :data:`MIM_FILES` under ``<target_root>/mmseg_gf/.mim``: relative
    symlinks to the checkout's (``link``: an editable install, where edits
    of the configs take effect), else copies (a built wheel)."""
    mim = osp.join(target_root, MIM_DIR)
    os.makedirs(mim, exist_ok=True)
    for name in MIM_FILES:
        src, dst = osp.join(ROOT, name), osp.join(mim, name)
        if not osp.exists(src):
            continue
        if osp.islink(dst) or osp.isfile(dst):
            os.remove(dst)
        elif osp.isdir(dst):
            shutil.rmtree(dst)
        if link:
            os.symlink(osp.relpath(src, mim), dst)
        elif osp.isdir(src):
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns(
                '__pycache__', '*.pyc'))
        else:
            shutil.copyfile(src, dst)


class BuildPy(build_py):
    """``build_py`` that also ships ``mmseg_gf/.mim``: copied into the
    build (a wheel), or linked in the checkout (an editable install)."""

    def run(self):
        super().run()
        if getattr(self, 'editable_mode', False):
            place_mim(ROOT, link=True)
        else:
            place_mim(self.build_lib, link=False)


class Develop(develop):
    """``setup.py develop`` (a legacy editable install): links
    ``mmseg_gf/.mim`` in the checkout too."""

    def run(self):
        super().run()
        place_mim(ROOT, link=True)


ext_modules, build_ext_class = native_extension()

setup(
    ext_modules=ext_modules,
    cmdclass=dict(build_ext=build_ext_class, build_py=BuildPy,
                  develop=Develop),
)
