"""The soak run, small: 40 steps of the shrunk Segformer-B0 on 8 input
sizes, one torch thread (a few seconds); resident memory does not grow and
every shape cache stays within its bound (the 1,000-step run over two
models: tools/soak.py, docs/benchmarks/soak_cpu.md)."""
import os

import pytest
import torch

from mmseg_gf.analysis import soak as soak_module
from mmseg_gf.analysis.soak import (RSS_TOLERANCE, random_shapes, soak,
                                    soak_config, soak_table)
from mmseg_gf.ops.backend import shape_caches


def test_random_shapes_are_distinct_and_in_range():
    shapes = random_shapes(50, (64, 64))
    assert len(set(shapes)) == 50
    assert all(48 <= s <= 128 and s % 8 == 0 for hw in shapes for s in hw)
    with pytest.raises(ValueError, match='distinct shapes'):
        random_shapes(10, (8, 8), ratio_range=(1.0, 1.0))


def test_unknown_model_is_refused():
    with pytest.raises(ValueError, match='segformer_b0'):
        soak_config('unet')


def test_bad_arguments_and_no_vm_rss_are_refused(monkeypatch):
    cfg = soak_config('segformer_b0')
    with pytest.raises(ValueError, match='at least 4 records'):
        soak(cfg, iters=30, shapes=[(32, 32)], interval=10)
    with pytest.raises(ValueError, match='needs shapes'):
        soak(cfg, iters=40, shapes=[], interval=10)
    monkeypatch.setattr(soak_module, 'vm_rss_bytes', lambda: None)
    with pytest.raises(RuntimeError, match='VmRSS'):
        soak(cfg, iters=40, shapes=[(32, 32)], interval=10)


@pytest.mark.skipif(not os.path.exists('/proc/self/status'),
                    reason='VmRSS is read from /proc (Linux)')
def test_small_soak_keeps_memory_flat_and_caches_bounded():
    shapes = random_shapes(8, (40, 40))
    threads = torch.get_num_threads()
    result = soak(soak_config('segformer_b0'), iters=40, shapes=shapes,
                  interval=5, threads=1)
    assert result['threads'] == 1 and torch.get_num_threads() == threads
    assert result["shapes"] == 8 and len(result["rss"]) == 8
    assert result['growth'] <= RSS_TOLERANCE, result['quarters_mib']
    assert result['over_bound'] == {}
    assert result['caches'] == shape_caches.shape_caches()
    assert 'bilinear_gemm.matrix' in result['caches']
    table = soak_table({'segformer_b0': result}, 'pytest')
    assert "| segformer_b0 | 40 | 8 |" in table
