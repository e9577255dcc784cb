"""Install mmseg_gf: ``pip install -e .`` (see README for the full stack).

If torch is importable at install time (``pip install --no-build-isolation``,
as the Makefile does), the optional CPU kernels ``mmseg_gf._patch_ops``
(patch sums, spreading, the fused backward, the filtered Linear's
backward on token grids) and ``mmseg_gf._bit_mask``
(activation bit masks of the lean trained region) and
``mmseg_gf._resized_loss`` (the cross-entropy of upsampled logits without
the upsampled logits) are compiled too;
``MMSEG_GF_BUILD_NATIVE=0`` skips them. Without them the pure-PyTorch path
runs (same results, slower on CPU).

The build switches (``MMSEG_GF_BUILD_NATIVE``, ``MMSEG_GF_UNITY_BUILD``)
are declared with the package's others in ``mmseg_gf/ops/backend/switches.py``
(docs/switches.md); this file reads them from the environment itself, since
it runs before the package and torch can be imported.
"""
import os

from setuptools import find_packages, setup


def native_extension():
    """``(ext_modules, cmdclass)`` for the optional CPU kernels."""
    if os.environ.get('MMSEG_GF_BUILD_NATIVE', '1') == '0':
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        return [], {}
    # OpenMP: at::parallel_for splits the work over threads only when the
    # extension itself is compiled with it. -g0: no debug information (the
    # interpreter's own flags ask for it), which took 40% of a file's
    # compile time and made the modules 40x larger; the code is the same.
    compile_args = ['-O3', '-g0', '-fopenmp']
    flags = dict(extra_compile_args=compile_args,
                 extra_link_args=['-fopenmp'])
    csrc = 'mmseg_gf/ops/csrc/'
    patch_ops = ('patch_kernels', 'output_recycler', 'cpu_dispatch',
                 'collapsed_backward', 'filtered_conv_node',
                 'bilinear_backward', 'token_grid_backward',
                 'token_rows_avx512')
    files = [csrc + name + '.cpp' for name in patch_ops + ('bindings', )]
    # One translation unit (patch_ops_unity.cpp includes the files): torch's
    # headers parsed once, not nine times. MMSEG_GF_UNITY_BUILD=0: one by
    # one, for quicker rebuilds after editing one file.
    unity = os.environ.get('MMSEG_GF_UNITY_BUILD', '1') != '0'
    exts = [
        CppExtension(
            'mmseg_gf._patch_ops',
            [csrc + 'patch_ops_unity.cpp'] if unity else files,
            # The headers (and the included files) too: `build_ext`
            # rebuilds only when a listed file is newer than the module.
            depends=[csrc + name + '.h' for name in patch_ops] +
            (files if unity else []),
            **flags),
        CppExtension('mmseg_gf._bit_mask',
                     ['mmseg_gf/ops/csrc/bit_mask.cpp'], **flags),
        # -fno-trapping-math: the softmax's clamped exp vectorises.
        CppExtension('mmseg_gf._resized_loss',
                     ['mmseg_gf/ops/csrc/resized_loss.cpp'],
                     extra_compile_args=compile_args +
                     ['-fno-trapping-math'],
                     extra_link_args=['-fopenmp']),
    ]
    return exts, {'build_ext': BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = native_extension()

setup(
    name='mmseg_gf',
    version='0.1.0',
    description='Gradient filtering for cheap finetuning in MMSegmentation',
    packages=find_packages(include=['mmseg_gf', 'mmseg_gf.*']),
    python_requires='>=3.8',
    # torch, mmcv (full build) and mmsegmentation are installed by the
    # Makefile in a fixed order: a bare `torch` requirement here would pull
    # a multi-GB CUDA build, and mmcv must be built against torch.
    install_requires=['numpy'],
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
