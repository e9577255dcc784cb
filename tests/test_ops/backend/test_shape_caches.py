"""The shape-cache registry (:mod:`mmseg_gf.ops.backend.shape_caches`): bounded
LRU caches that report their sizes, and no unbounded cache in the
package."""
import pathlib
import re

import pytest
import torch

from mmseg_gf.ops.backend import extension, output_pool, shape_caches
from mmseg_gf.ops.resize import gemm as bilinear_gemm
from mmseg_gf.ops.backend.shape_caches import BoundedDict

PACKAGE = pathlib.Path(__file__).resolve().parents[3] / 'mmseg_gf'


def test_lru_registers_and_stays_within_its_bound():
    calls = []

    @shape_caches.lru('test.squares', 3)
    def square(n):
        calls.append(n)
        return n * n

    try:
        for n in (1, 2, 3, 1, 4, 5):
            assert square(n) == n * n
        entry = shape_caches.shape_caches()['test.squares']
        assert entry == dict(size=3, bound=3, unit='entries')
        assert square(1) == 1 and calls == [1, 2, 3, 4, 5]  # 1 kept (LRU)
        assert square(2) == 4 and calls[-1] == 2  # 2 was evicted
        shape_caches.clear_shape_caches()
        assert shape_caches.shape_caches()['test.squares']['size'] == 0
    finally:
        shape_caches._CACHES.pop('test.squares')


def test_bad_registrations_are_refused():
    with pytest.raises(ValueError, match='positive int maxsize'):
        shape_caches.lru('test.unbounded', None)
    with pytest.raises(ValueError, match='"entries" or "bytes"'):
        shape_caches.register('test.unit', 1, lambda: 0, unit='pages')
    assert 'test.unit' not in shape_caches.shape_caches()


def test_bounded_dict_drops_the_least_recently_used():
    d = BoundedDict(2, a=1)
    d['b'] = 2
    assert d['a'] == 1  # a used last: b goes first
    d['c'] = 3
    assert list(d) == ['a', 'c'] and 'b' not in d
    assert len(BoundedDict(2, {i: i for i in range(5)})) == 2


def test_over_bound_names_a_cache_over_its_bound():
    size = [5]
    shape_caches.register('test.broken', 4, lambda: size[0], unit='bytes')
    try:
        assert shape_caches.over_bound() == {
            'test.broken': dict(size=5, bound=4, unit='bytes')}
        size[0] = 4
        assert shape_caches.over_bound() == {}
    finally:
        shape_caches._CACHES.pop('test.broken')


def test_bilinear_matrices_are_listed_and_bounded():
    bilinear_gemm._matrix.cache_clear()
    for n in range(bilinear_gemm.MATRIX_CACHE_SIZE + 10):
        bilinear_gemm.interpolation_matrix(n + 2, 3, False, None,
                                           torch.float32, 'cpu')
    caches = shape_caches.shape_caches()
    assert caches['bilinear_gemm.matrix'] == dict(
        size=bilinear_gemm.MATRIX_CACHE_SIZE,
        bound=bilinear_gemm.MATRIX_CACHE_SIZE, unit='entries')
    assert 'bilinear_gemm.kronecker' in caches
    assert 'native.recycled_outputs' in caches
    assert shape_caches.over_bound() == {}


def test_tuning_keeps_a_bounded_autotune_cache(monkeypatch):
    """The installed triton's own ``Autotuner`` (its ``run`` fills
    ``self.cache``) keeps at most ``TUNED_KEYS`` choices once bounded; a
    key dropped is tuned again when it comes back."""
    triton = pytest.importorskip('triton')
    triton_launch = pytest.importorskip(
        'mmseg_gf.ops.backend.triton_launch')
    monkeypatch.setattr(triton_launch, 'TUNED_KEYS', 3)
    timed, launched = [], []

    def kernel(n, BLOCK):  # what the autotuner unwraps to (``.fn``)
        pass

    class Launcher:  # stands for a JITFunction: ``arg_names``, ``run``
        arg_names = ['n', 'BLOCK']
        fn = staticmethod(kernel)

        def run(self, *args, **kwargs):
            launched.append((args, kwargs['BLOCK']))

    def do_bench(call, quantiles=None):
        call()
        timed.append(1)
        return float(len(timed) % 2 == 0)  # the first (BLOCK=1) wins

    autotuned = triton.autotune(
        configs=[triton.Config({'BLOCK': b}) for b in (1, 2)], key=['n'],
        do_bench=do_bench)(Launcher())
    tuning = triton_launch.Tuning(lambda: autotuned, 'test.tuning')
    try:
        tuning._tuner = triton_launch._bounded(autotuned)
        assert isinstance(autotuned.cache, shape_caches.BoundedDict)
        for n in (1, 2, 3, 4, 5, 5, 4):
            autotuned.run(n)
        assert launched[-1] == ((4, ), 1)
        assert shape_caches.shape_caches()['test.tuning'] == dict(
            size=3, bound=3, unit='entries')
        assert len(timed) == 2 * 5  # keys 1-5 tuned once each
        autotuned.run(1)  # dropped (least recently used): tuned again
        assert len(timed) == 2 * 6 and len(autotuned.cache) == 3
        tuning.forget()
        assert tuning.tuned_keys() == 0
    finally:
        shape_caches._CACHES.pop('test.tuning')


#: Forms of an unbounded memo: a cache keyed on shapes must have a bound.
_UNBOUNDED = re.compile(
    r'lru_cache\(\s*maxsize\s*=\s*None|lru_cache\s*$|lru_cache\(\)|'
    r'functools\.cache\b|^\s*@cache\b', re.MULTILINE)


def test_no_unbounded_memo_in_the_package():
    found = [f'{path.relative_to(PACKAGE)}:{m.group(0)}'
             for path in sorted(PACKAGE.rglob('*.py'))
             for m in _UNBOUNDED.finditer(path.read_text())]
    assert not found, found


def test_output_pool_reports_the_limit_it_holds():
    if not extension.built():
        pytest.skip('the CPU kernels (mmseg_gf/_patch_ops) are not built')
    previous = output_pool.recycle_limit(5 << 20)
    try:
        entry = shape_caches.shape_caches()['native.recycled_outputs']
        assert entry['bound'] == 5 << 20 and entry['unit'] == 'bytes'
        assert entry['size'] <= 5 << 20
        assert output_pool.current_recycle_limit() == 5 << 20
    finally:
        output_pool.recycle_limit(previous)
    assert output_pool.current_recycle_limit() == previous
