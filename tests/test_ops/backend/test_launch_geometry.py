"""The host's launch arithmetic (``ops/backend/launch_geometry.py``)
gives triton's integers, and the cached tiles are those computed afresh."""
import pytest

from mmseg_gf.ops.backend.launch_geometry import cdiv, next_power_of_2

triton = pytest.importorskip('triton')


def test_same_integers_as_triton():
    for n in range(-3, 4200):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 7, 8, 16, 64, 1000):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)


def test_cached_tiles_are_read_only_and_stable():
    from mmseg_gf.ops.conv import kernels as triton_kernels
    from mmseg_gf.ops.conv import products_kernels
    first = triton_kernels.reduce_meta([0, 4, 3], (0, 4, 5), True)
    assert first is triton_kernels.reduce_meta((0, 4, 3), [0, 4, 5], 1)
    assert dict(first) == dict(ROW_SIZE=4, COL_SIZE=4, BLOCK_P=8,
                               CHANNELS_FAST=True)
    with pytest.raises(TypeError):
        first['BLOCK_P'] = 1
    assert dict(triton_kernels.spread_meta(9, 300)) == dict(BLOCK_H=8,
                                                            BLOCK_W=128)
    shape = products_kernels.Shape(1, 40, 3, 6, 5, True, True, False)
    assert dict(products_kernels.fixed_tiles(shape)) == dict(
        BLOCK_M=64, BLOCK_N=16, BLOCK_K=32, BLOCK_C=16, BLOCK_O=32,
        BLOCK_P=16)
