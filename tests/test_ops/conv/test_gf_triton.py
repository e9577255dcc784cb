"""The Triton GPU path (``mmseg_gf.ops.conv.gpu``).

Its kernels are checked by ``tests/helpers/triton_cases.py`` in a subprocess:
under triton's interpreter on CPU tensors (every machine with triton, no
GPU needed) and compiled on CUDA where there is a GPU. ``TRITON_INTERPRET``
only takes effect before triton is imported, and in this process it must
stay off (every CPU conv would take the interpreter), hence the
subprocess. The tests here also cover the switch and a machine without
triton.
"""
import os
import subprocess
import sys

import pytest
import torch

from mmseg_gf.ops import gradient_filtered_conv2d
from mmseg_gf.ops.backend import availability, triton_runtime
from mmseg_gf.ops.conv import gpu as conv_gpu
from tests.helpers.devices import needs_cuda
from tests.helpers.triton_runs import (
    CASE_RUNS, ROOT, TRITON, TRITON_VERSION, run_case_file)

CUDA = needs_cuda


@TRITON
@pytest.mark.parametrize('interpret', CASE_RUNS)
def test_kernel_cases(interpret):
    """Every case of ``triton_cases.py``: on CPU tensors, interpreted; on
    CUDA tensors, compiled (float16 autocast too)."""
    run_case_file('triton_cases.py', interpret)


@TRITON
@pytest.mark.cuda
@CUDA
def test_cuda_graphs_reduce_overhead_gives_eager_gradients():
    """``torch.compile(mode='reduce-overhead')``: inductor plus CUDA
    graphs, with the Triton ops captured; replays give eager gradients."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 30, 22, generator=gen).cuda().requires_grad_()
    w = torch.randn(32, 16, 3, 3, generator=gen).cuda().requires_grad_()
    b = torch.randn(32, generator=gen).cuda().requires_grad_()

    def loss(x, w, b):
        out = gradient_filtered_conv2d(x, w, b, 1, 1, 1, 1, 4)
        return (out * out).sum()

    def grads(fn):
        for t in (x, w, b):
            t.grad = None
        fn(x, w, b).backward()
        return [t.grad.clone() for t in (x, w, b)]

    eager = grads(loss)
    compiled = torch.compile(loss, mode='reduce-overhead', fullgraph=True)
    for _ in range(3):  # warm-up, record, replay
        got = grads(compiled)
    for g, r in zip(got, eager):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)


# (kernel, pointer dtypes, constexprs besides the tile sizes, geometry):
# the forward's x sums (bfloat16, r = 4, stride 2), g_y means with the bias
# partial sums (float16 g_y, r = 2 on a 160-wide map; float32 channels-last
# at r = 4), float64 at r = 1, and
# the spread from a float32 grid into bfloat16 / float64 maps.
_BLOCK = dict(MASKED=True, NORM=True, NORM_WEIGHT=True, TAPS=False)
_NO_BLOCK = dict(MASKED=False, NORM=False, NORM_WEIGHT=False, TAPS=False)
_PRODUCTS = ('means', 'pooled', 'partial', 'grad_w', 'grad_b', 'kernel',
             'out')
_TILES = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=32, BLOCK_C=64, BLOCK_O=32,
              BLOCK_P=16, COL_SIZE=4)


def _products(dtypes, **flags):
    """Pointer types of :mod:`triton_products`' kernel and its flags."""
    return dict(zip(_PRODUCTS, dtypes)), dict(dict(
        HAS_W=True, HAS_B=True, HAS_X=True, DEPTHWISE=False, ACC='fp32'),
        **flags)


# (kernel, pointer types, constexpr flags, tile geometry: the wrapper's
# meta arguments for triton_kernels, or the tile sizes themselves)
SPECIALIZATIONS = {
    'x_sums_bf16': ('_patch_reduce', dict(src='bf16', dst='bf16',
                                          partial='bf16'),
                    dict(MEAN=False, PARTIAL=False, ACC='fp32', **_NO_BLOCK),
                    ((-1, 8, 15), (-1, 8, 20))),
    'gy_means_fp16': ('_patch_reduce', dict(src='fp16', dst='fp32',
                                            partial='fp32'),
                      dict(MEAN=True, PARTIAL=True, ACC='fp32', **_NO_BLOCK),
                      ((0, 2, 60), (0, 2, 80))),
    'gy_means_fp64_r1': ('_patch_reduce', dict(src='fp64', dst='fp64',
                                               partial='fp64'),
                         dict(MEAN=True, PARTIAL=True, ACC='fp64',
                              **_NO_BLOCK),
                         ((0, 1, 14), (0, 1, 14))),
    # a channels-last g_y: programs numbered channel first
    'gy_means_channels_last': ('_patch_reduce', dict(src='fp32', dst='fp32',
                                                     partial='fp32'),
                               dict(MEAN=True, PARTIAL=True, ACC='fp32',
                                    **_NO_BLOCK),
                               ((0, 4, 30), (0, 4, 40), True)),
    # a conv block's gradient: the activation's mask and the norm's factor
    'gy_means_conv_block_fp16': ('_patch_reduce', dict(
        src='fp16', dst='fp32', partial='fp32', bits='u8', var='fp32',
        norm_w='fp32'), dict(MEAN=True, PARTIAL=True, ACC='fp32', **_BLOCK),
        ((0, 4, 30), (0, 4, 40))),
    # the tap sums of a bfloat16 kernel in the same launch
    'gy_means_taps_bf16': ('_patch_reduce', dict(
        src='bf16', dst='fp32', partial='fp32', weight='bf16',
        tap_sums='fp32'), dict(MEAN=True, PARTIAL=True, ACC='fp32',
                               **dict(_NO_BLOCK, TAPS=True)),
        ((0, 4, 30), (0, 4, 40))),
    'spread_bf16': ('_spread', dict(grid='fp32', out='bf16'), {}, (120, 160)),
    'spread_fp64': ('_spread', dict(grid='fp64', out='fp64'), {}, (14, 14)),
    # ops/conv/products_kernels.py
    'products_fp32': ('_products', *_products(['fp32'] * 7), _TILES),
    'products_bf16_weight': ('_products', *_products(
        ['fp32', 'bf16', 'fp32', 'bf16', 'fp32', 'fp32', 'bf16'],
        HAS_B=False), _TILES),
    'products_fp64': ('_products', *_products(['fp64'] * 7, ACC='fp64'),
                      dict(_TILES, BLOCK_M=16, BLOCK_N=16, BLOCK_C=16,
                           COL_SIZE=2)),
    'products_depthwise_fp16': ('_products', *_products(
        ['fp32', 'fp16', 'fp32', 'fp16', 'fp32', 'fp32', 'fp16'],
        DEPTHWISE=True), dict(_TILES, BLOCK_P=32, COL_SIZE=8)),
    # the Linear's input side alone, from its bfloat16 weight
    'products_input_only_bf16': ('_products', *_products(
        ['fp32', 'fp32', 'fp32', 'fp32', 'fp32', 'bf16', 'bf16'],
        HAS_W=False, HAS_B=False), _TILES),
    # ops/linear/kernels.py: a Linear's g_y on token rows, bfloat16
    # at r = 4 (Swin's 7x7 windows), float64 at r = 2 (a narrow block)
    'token_means_bf16': ('_token_patch_means', dict(src='bf16'),
                         dict(ACC='fp32'), (4, 96)),
    'token_means_fp64': ('_token_patch_means', dict(
        src='fp64', means='fp64', partial='fp64'), dict(ACC='fp64'),
        (2, 20)),
    # ops/bit_mask/kernels.py: a ReLU6's output and mask
    'pack_relu6_bf16': ('_pack', dict(x='bf16', y='bf16', bits='u8'),
                        dict(BOUNDED=True, NAN_BIT=True, ACT=1), {}),
    # ops/conv_block/kernels.py: a conv block's forward after the
    # conv, float16 with the input's patch sums; float32 LeakyReLU without
    'block_forward_fp16': ('_block_forward', dict(
        y='fp16', out='fp16', bits='u8', x='fp16', sums='fp16'), dict(
        BOUNDED=False, NAN_BIT=True, ACT=1, NORM_WEIGHT=True, NORM_BIAS=True,
        SUMS=True, ACC='fp32'), ((0, 4, 30), (0, 4, 40))),
    'block_forward_leaky_channels_last': ('_block_forward', dict(
        y='fp32', out='fp32', bits='u8', x='fp32', sums='fp32'), dict(
        BOUNDED=False, NAN_BIT=False, ACT=2, NORM_WEIGHT=False,
        NORM_BIAS=False, SUMS=False, ACC='fp32'),
        ((0, 2, 30), (0, 2, 40), True)),
}
#: Pointer arguments besides those a specialization types (float32).
_POINTERS = ('bits', 'var', 'norm_w', 'dst', 'partial', 'weight',
             'tap_sums', 'mean', 'norm_b', 'means')
#: Float scalars of the kernels (the others are integers).
_FLOATS = ('scale', 'off_scale', 'eps', 'lo', 'hi')


def _kernel_and_meta(name, geometry):
    from mmseg_gf.ops.bit_mask import kernels as triton_bit_mask_kernels
    from mmseg_gf.ops.conv_block import kernels as triton_conv_block_kernels
    from mmseg_gf.ops.conv import kernels as triton_kernels
    from mmseg_gf.ops.conv import products_kernels as triton_products
    from mmseg_gf.ops.linear import kernels as triton_token_kernels
    if name == '_patch_reduce':
        return triton_kernels._patch_reduce, triton_kernels.reduce_meta(
            *geometry)
    if name == '_spread':
        return triton_kernels._spread, triton_kernels.spread_meta(*geometry)
    if name == '_pack':
        return triton_bit_mask_kernels._pack, dict(
            BLOCK=triton_bit_mask_kernels.PACK_BLOCK)
    if name == '_block_forward':
        return triton_conv_block_kernels._block_forward, dict(
            triton_kernels.reduce_meta(*geometry),
            BLOCK=triton_bit_mask_kernels.PACK_BLOCK)
    if name == '_token_patch_means':
        return (triton_token_kernels._token_patch_means,
                triton_token_kernels.token_meta(*geometry))
    return getattr(triton_products, name), dict(geometry)


@TRITON
@pytest.mark.parametrize('spec', list(SPECIALIZATIONS.values()),
                         ids=list(SPECIALIZATIONS))
def test_kernels_compile_for_h100(spec):
    """Triton compiles the kernels down to an sm_90 cubin without a GPU
    (its own LLVM and ptxas): what the interpreter cannot see (types of
    loop-carried values, layouts of the 3-D reductions, one-element
    ranges, ``tl.dot``'s operand types) fails here, on every machine with
    triton."""
    name, pointers, flags, geometry = spec
    kernel, meta = _kernel_and_meta(name, geometry)
    _compile_for_h100(name, kernel, pointers, dict(flags, **meta))


@TRITON
def test_tuning_configs_compile_for_h100():
    """Every tiling ``triton.autotune`` may pick for the fused products
    (its warps included) compiles to an sm_90 cubin: dense, and depthwise
    from float16."""
    from mmseg_gf.ops.conv import products_kernels as triton_products
    for config in triton_products.tuning_configs():
        tiles = dict(config.kwargs, COL_SIZE=4)
        for pointers, flags in (_products(['fp32'] * 7),
                                _products(['fp32', 'fp16', 'fp32', 'fp16',
                                           'fp32', 'fp32', 'fp16'],
                                          DEPTHWISE=True)):
            _compile_for_h100('_products', triton_products._products,
                              pointers, dict(flags, **tiles),
                              num_warps=config.num_warps)


@TRITON
def test_tuning_is_taken_on_a_gpu_unless_switched_off(switch_override):
    """Outside the interpreter launches take the autotuner, built once;
    ``MMSEG_GF_AUTOTUNE=0`` or a triton whose ``autotune`` refuses the
    arguments gives fixed tiles; ``using`` overrides both."""
    from mmseg_gf.ops.backend.triton_launch import Tuning
    built = []
    tuning = Tuning(lambda: built.append(object()) or built[-1])
    switch_override(TRITON_INTERPRET=False, MMSEG_GF_AUTOTUNE=True)
    assert tuning.tuner() is built[0] and tuning.tuner() is built[0]
    switch_override(MMSEG_GF_AUTOTUNE=False)
    assert tuning.tuner() is None
    with tuning.using('mine'):
        assert tuning.tuner() == 'mine'

    def refuse():
        raise TypeError("autotune() got an unexpected keyword 'do_bench'")

    switch_override(MMSEG_GF_AUTOTUNE=True)
    assert Tuning(refuse).tuner() is None


def _compile_for_h100(name, kernel, pointers, constexprs, num_warps=4):
    """``kernel`` compiled to an sm_90 cubin with these pointer types and
    constexprs (the other arguments: float32 pointers, floats, int32)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mmseg_gf.ops.conv import kernels as triton_kernels
    constexprs = dict(constexprs)
    if 'ACC' in constexprs:
        constexprs['ACC'] = getattr(tl, {'fp32': 'float32',
                                         'fp64': 'float64'}[constexprs['ACC']])
    signature = {
        arg: ('constexpr' if arg in constexprs else
              '*' + pointers.get(arg, 'fp32') if arg in pointers
              or arg in _POINTERS else
              'fp32' if arg in _FLOATS else 'i32')
        for arg in kernel.arg_names
    }
    if TRITON_VERSION >= (3, 3):
        constants = {(kernel.arg_names.index(arg), ): value
                     for arg, value in constexprs.items()}
    else:  # keyed by name, the constexprs left out of the signature
        constants = dict(constexprs)
        signature = {arg: kind for arg, kind in signature.items()
                     if kind != 'constexpr'}
    source = ASTSource(kernel, signature, constants)
    compiled = triton.compile(source, target=GPUTarget('cuda', 90, 32),
                              options=dict(triton_kernels.LAUNCH_OPTIONS,
                                           num_warps=num_warps))
    assert len(compiled.asm['cubin']) > 0
    assert f'.entry {name}(' in compiled.asm['ptx']


def test_switch_and_cpu_tensors_without_the_interpreter(switch_override):
    """``set_enabled`` overrides ``MMSEG_GF_TRITON``; CPU tensors never take
    the Triton path unless the interpreter was on at import."""
    x, w = torch.zeros(1, 2, 4, 4), torch.zeros(2, 2, 3, 3)
    assert not conv_gpu.usable(x, w, None)
    switch_override(MMSEG_GF_TRITON=False)
    assert not availability.triton_enabled()
    previous = availability.set_triton_enabled(True)
    try:
        assert availability.triton_enabled() == availability.triton_installed()
        availability.set_triton_enabled(None)
        assert not availability.triton_enabled()
        switch_override(MMSEG_GF_TRITON=True)
        assert availability.triton_enabled() == availability.triton_installed()
    finally:
        availability.set_triton_enabled(previous)


def test_package_runs_without_triton():
    """With ``import triton`` failing, mmseg_gf imports, reports the path
    unavailable and computes filtered gradients (pure PyTorch / C++)."""
    code = '\n'.join([
        'import sys', 'sys.modules["triton"] = None',
        'import torch', 'from mmseg_gf.ops import gradient_filtered_conv2d',
        'from mmseg_gf.ops.backend import availability',
        'from mmseg_gf.ops.conv import gpu as conv_gpu',
        'assert not availability.triton_installed()',
        'assert not availability.triton_enabled()',
        'x = torch.randn(1, 2, 6, 6, requires_grad=True)',
        'w = torch.randn(3, 2, 3, 3, requires_grad=True)',
        'gradient_filtered_conv2d(x, w, None, 1, 1, 1, 1, 2).sum().backward()',
        'assert x.grad.shape == x.shape and w.grad.abs().sum() > 0',
        'assert conv_gpu.backward_calls() == 0',
        'print("ok")'])
    env = dict(os.environ, TRITON_INTERPRET='1')
    env['PYTHONPATH'] = os.pathsep.join(
        p for p in (str(ROOT), env.get('PYTHONPATH')) if p)
    proc = subprocess.run([sys.executable, '-c', code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == 'ok', proc.stderr


def test_triton_version_from_package_metadata(monkeypatch):
    """The version that decides whether the path is on (>= MIN_TRITON) is
    read from the package metadata, local and pre-release tags dropped."""
    import importlib.metadata
    import importlib.util
    monkeypatch.setattr(importlib.util, 'find_spec', lambda name: object())
    for text, want in (('3.6.0', (3, 6, 0)), ('3.2.0+git4f6f7b8', (3, 2, 0)),
                       ('3.10.0rc1', (3, 10, 0))):
        monkeypatch.setattr(importlib.metadata, 'version', lambda n, t=text: t)
        assert triton_runtime.triton_version() == want
    assert (3, 1, 9) < triton_runtime.MIN_TRITON <= (3, 2, 0)
