"""What keeping a non-finite gradient local would cost the GEMM resize
(:mod:`mmseg_gf.analysis.resize_nonfinite`, the figures of
docs/benchmarks/resize_nonfinite_cpu.md): the local variant puts NaN / inf
where torch's kernel does, and the table is measured on tiny cases."""
import torch

from mmseg_gf.analysis import resize_nonfinite
from mmseg_gf.ops.backend.device_path import as_on_cuda


def test_local_variant_puts_non_finite_values_where_torch_does():
    grad = torch.randn(1, 2, 6, 6, dtype=torch.float64)
    grad[0, 0, 2, 3] = float('nan')
    grad[0, 1, 5, 0] = float('-inf')
    with as_on_cuda():
        local = resize_nonfinite.local_nonfinite_backward(grad, (3, 3),
                                                          False)
        gemm = resize_nonfinite.VARIANTS['gemm'](grad, (3, 3), False)
    plain = resize_nonfinite.VARIANTS['torch'](grad, (3, 3), False)
    assert torch.equal(local.isnan(), plain.isnan())
    assert torch.equal(local.isinf(), plain.isinf())
    finite = plain.isfinite()
    torch.testing.assert_close(local[finite], plain[finite])
    assert gemm.isnan().sum() > plain.isnan().sum()  # the plane pattern


def test_measure_and_table_on_a_tiny_case():
    rows = resize_nonfinite.measure(
        repeats=1, cases=(('tiny', 1, 2, (3, 3), (6, 6)), ))
    assert list(rows[0]) == ['case', 'batch', 'channels', 'in_hw', 'out_hw',
                             *resize_nonfinite.VARIANTS]
    assert all(rows[0][v] > 0 for v in resize_nonfinite.VARIANTS)
    assert '| tiny (batch 1) |' in resize_nonfinite.markdown(rows, 'cmd')
