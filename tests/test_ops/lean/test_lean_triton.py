"""The lean region's Triton kernels: bit masks and masked activations
(``mmseg_gf.ops.bit_mask.gpu``), the frozen batch norm's backward
(``triton_norm``) and the resized cross-entropy (``resized_loss``'s
Triton path).

Their cases run in a subprocess (see ``tests/helpers/triton_runs.py``):
under triton's
interpreter on CPU tensors, compiled on CUDA where there is a GPU. Here:
that CPU tensors outside the interpreter never take them.
"""
import pytest
import torch

from mmseg_gf.ops.bit_mask import masks as bit_mask, gpu as triton_bit_mask
from mmseg_gf.ops.resized_loss import loss as resized_loss
from mmseg_gf.ops.frozen_norm import gpu as triton_norm
from tests.helpers.triton_runs import CASE_RUNS, TRITON, run_case_file

CASE_FILES = ['triton_bit_mask_cases.py', 'triton_norm_cases.py',
              'triton_loss_cases.py']


@TRITON
@pytest.mark.parametrize('interpret', CASE_RUNS)
@pytest.mark.parametrize('name', CASE_FILES)
def test_kernel_cases(name, interpret):
    run_case_file(name, interpret)


def test_cpu_tensors_take_the_cpu_paths():
    x = torch.randn(2, 4, 3, 3)
    assert not triton_bit_mask.usable(x) and not triton_norm.usable(x)
    assert not resized_loss.triton_usable(x)
    assert bit_mask.activate_and_pack(x, 'clamp', 0.0, None, True, 0.0,
                                      False) is None
