"""Every function the compiled CPU kernels expose to Python checks its
arguments: zero-sized, mismatched, wrongly typed or laid out tensors and
out-of-range geometry raise a RuntimeError naming the problem, never read
or write out of bounds.

The calls run in one child process, each reported as it finishes: a crash
(a signal) fails the test and the last case reported before it names the
culprit."""
import json
import os
import subprocess
import sys

import pytest

from mmseg_gf.ops.bit_mask import masks as bit_mask
from mmseg_gf.ops.backend import availability, extension
from mmseg_gf.ops.conv import cpu as conv_cpu
from mmseg_gf.ops.resized_loss import loss as resized_loss

pytestmark = pytest.mark.skipif(
    extension.module('patch_ops') is None or not extension.built('bit_mask')
    or resized_loss._kernel is None,
    reason='compiled CPU kernels not built')

REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.dirname(os.path.abspath(__file__)))))

# Each case: name -> a Python expression over torch, ``P`` (mmseg_gf.
# _patch_ops), ``B`` (_bit_mask) and ``L`` (_resized_loss), ``e`` =
# torch.empty, ``z`` = torch.zeros. All must raise RuntimeError.
REFUSED = {
    # bilinear_backward(grad, out, align_corners, scale_h, scale_w)
    'bilinear zero-sized input map':
        'P.bilinear_backward(z(1, 2, 4, 4), e(1, 2, 0, 3), False, -1., -1.)',
    'bilinear zero-sized input width':
        'P.bilinear_backward(z(1, 2, 4, 4), e(1, 2, 3, 0), True, -1., -1.)',
    'bilinear zero-sized gradient map':
        'P.bilinear_backward(z(1, 2, 0, 4), e(1, 2, 3, 3), False, -1., -1.)',
    'bilinear batch mismatch':
        'P.bilinear_backward(z(2, 2, 4, 4), e(1, 2, 3, 3), False, -1., -1.)',
    'bilinear 3-d':
        'P.bilinear_backward(z(2, 4, 4), e(2, 3, 3), False, -1., -1.)',
    'bilinear dtypes differ':
        'P.bilinear_backward(z(1, 1, 4, 4), e(1, 1, 2, 2, '
        'dtype=torch.float64), False, -1., -1.)',
    'bilinear integer':
        'P.bilinear_backward(z(1, 1, 4, 4, dtype=torch.int32), '
        'e(1, 1, 2, 2, dtype=torch.int32), False, -1., -1.)',
    'bilinear non-contiguous result':
        'P.bilinear_backward(z(1, 1, 4, 4), e(1, 1, 2, 4)[..., ::2], False, '
        '-1., -1.)',
    # patch_sums(input, start_h, size_h, count_h, start_w, size_w, count_w,
    #            channel_major)
    'patch_sums zero-sized map':
        'P.patch_sums(z(1, 2, 0, 4), 0, 2, 1, 0, 2, 2, False)',
    'patch_sums patch size 0': 'P.patch_sums(z(1, 2, 4, 4), 0, 0, 2, 0, 2, '
                               '2, False)',
    'patch_sums count 0': 'P.patch_sums(z(1, 2, 4, 4), 0, 2, 0, 0, 2, 2, '
                          'False)',
    'patch_sums 3-d': 'P.patch_sums(z(2, 4, 4), 0, 2, 2, 0, 2, 2, False)',
    'patch_sums half': 'P.patch_sums(z(1, 1, 4, 4, dtype=torch.half), 0, 2, '
                       '2, 0, 2, 2, False)',
    'patch_sums non-contiguous':
        'P.patch_sums(z(1, 1, 4, 8)[..., ::2], 0, 2, 2, 0, 2, 2, False)',
    'patch_sums huge geometry':
        'P.patch_sums(z(1, 1, 4, 4), -(1 << 62), 1 << 62, 1, 0, 2, 2, False)',
    # spread(grid, height, width, start_h, size_h, start_w, size_w)
    'spread zero-sized target': 'P.spread(z(1, 2, 2, 2), 0, 4, 0, 2, 0, 2)',
    'spread zero-sized grid': 'P.spread(z(1, 2, 0, 2), 4, 4, 0, 2, 0, 2)',
    'spread patch size 0': 'P.spread(z(1, 2, 2, 2), 4, 4, 0, 0, 0, 2)',
    'spread 5-d': 'P.spread(z(1, 1, 2, 2, 2), 4, 4, 0, 2, 0, 2)',
    # collapsed_backward(grad_output, pooled, weight, groups, scale, in_h,
    #   in_w, start_h, size_h, start_w, size_w, radius, need_input,
    #   need_weight, need_bias)
    'collapsed groups 0':
        'P.collapsed_backward(z(1, 2, 4, 4), None, z(2, 2, 1, 1), 0, 1., 4, '
        '4, 0, 2, 0, 2, 2, True, False, False)',
    'collapsed radius 0':
        'P.collapsed_backward(z(1, 2, 4, 4), None, z(2, 2, 1, 1), 1, 1., 4, '
        '4, 0, 2, 0, 2, 0, True, False, False)',
    'collapsed empty batch':
        'P.collapsed_backward(z(0, 2, 4, 4), None, z(2, 2, 1, 1), 1, 1., 4, '
        '4, 0, 2, 0, 2, 2, True, False, True)',
    'collapsed zero-sized map':
        'P.collapsed_backward(z(1, 2, 0, 4), None, z(2, 2, 1, 1), 1, 1., 4, '
        '4, 0, 2, 0, 2, 2, True, False, False)',
    'collapsed zero-sized input size':
        'P.collapsed_backward(z(1, 2, 4, 4), None, z(2, 2, 1, 1), 1, 1., 0, '
        '4, 0, 2, 0, 2, 2, True, False, False)',
    'collapsed 2-d weight':
        'P.collapsed_backward(z(1, 2, 4, 4), None, z(2, 2), 1, 1., 4, 4, 0, '
        '2, 0, 2, 2, True, False, False)',
    'collapsed weight of other channels':
        'P.collapsed_backward(z(1, 2, 4, 4), None, z(3, 2, 1, 1), 1, 1., 4, '
        '4, 0, 2, 0, 2, 2, True, False, False)',
    'collapsed weight dtype':
        'P.collapsed_backward(z(1, 2, 4, 4), None, z(2, 2, 1, 1, '
        'dtype=torch.float64), 1, 1., 4, 4, 0, 2, 0, 2, 2, True, False, '
        'False)',
    'collapsed pooled input missing':
        'P.collapsed_backward(z(1, 2, 4, 4), None, z(2, 2, 1, 1), 1, 1., 4, '
        '4, 0, 2, 0, 2, 2, False, True, False)',
    'collapsed pooled input of other size':
        'P.collapsed_backward(z(1, 2, 4, 4), z(1, 2, 3, 2), z(2, 2, 1, 1), '
        '1, 1., 4, 4, 0, 2, 0, 2, 2, False, True, False)',
    'collapsed pooled input 3-d':
        'P.collapsed_backward(z(1, 2, 4, 4), z(2, 2, 2), z(2, 2, 1, 1), 1, '
        '1., 4, 4, 0, 2, 0, 2, 2, False, True, False)',
    # filtered_conv2d(input, weight, bias, stride, padding, dilation, groups,
    #   radius, start_h, size_h, start_w, size_w)
    'filtered_conv2d empty batch':
        'P.filtered_conv2d(z(0, 2, 4, 4, requires_grad=True), z(2, 2, 1, 1),'
        ' None, [1, 1], [0, 0], [1, 1], 1, 2, 0, 2, 0, 2)',
    'filtered_conv2d zero-sized map':
        'P.filtered_conv2d(z(1, 2, 0, 4), z(2, 2, 1, 1), None, [1, 1], '
        '[0, 0], [1, 1], 1, 2, 0, 2, 0, 2)',
    'filtered_conv2d groups 0':
        'P.filtered_conv2d(z(1, 2, 4, 4), z(2, 2, 1, 1), None, [1, 1], '
        '[0, 0], [1, 1], 0, 2, 0, 2, 0, 2)',
    'filtered_conv2d channels mismatch':
        'P.filtered_conv2d(z(1, 3, 4, 4), z(2, 2, 1, 1), None, [1, 1], '
        '[0, 0], [1, 1], 1, 2, 0, 2, 0, 2)',
    'filtered_conv2d bias of other size':
        'P.filtered_conv2d(z(1, 2, 4, 4), z(2, 2, 1, 1), z(3), [1, 1], '
        '[0, 0], [1, 1], 1, 2, 0, 2, 0, 2)',
    'filtered_conv2d stride 0':
        'P.filtered_conv2d(z(1, 2, 4, 4), z(2, 2, 1, 1), None, [0, 1], '
        '[0, 0], [1, 1], 1, 2, 0, 2, 0, 2)',
    'filtered_conv2d patch size 0':
        'P.filtered_conv2d(z(1, 2, 4, 4), z(2, 2, 1, 1), None, [1, 1], '
        '[0, 0], [1, 1], 1, 2, 0, 0, 0, 2)',
    'filtered_conv2d radius 0':
        'P.filtered_conv2d(z(1, 2, 4, 4), z(2, 2, 1, 1), None, [1, 1], '
        '[0, 0], [1, 1], 1, 0, 0, 2, 0, 2)',
    'filtered_conv2d radius past the maximum':
        'P.filtered_conv2d(z(1, 2, 4, 4, requires_grad=True), '
        'z(2, 2, 1, 1), None, [1, 1], [0, 0], [1, 1], 1, (1 << 63) - 1, 0, '
        '2, 0, 2)',
    'collapsed radius past the maximum':
        'P.collapsed_backward(z(1, 2, 4, 4), None, z(2, 2, 1, 1), 1, 1., 4, '
        '4, 0, 2, 0, 2, (1 << 16) + 1, True, False, False)',
    # token_patch_sums(rows, radius); token_filtered_backward(grad_rows,
    #   x_sums, weight, grad_x_rows, radius, need_weight, need_bias,
    #   chunk_bytes, stream_bytes)
    'token_patch_sums radius past the maximum':
        'P.token_patch_sums(z(1, 3, 5, 4), (1 << 16) + 1)',
    'token_filtered_backward radius 2**63 - 1 (H + r - 1 overflows)':
        'P.token_filtered_backward(z(1, 3, 5, 3), z(1, 1, 1, 4), z(3, 4), '
        'e(1, 3, 5, 4), (1 << 63) - 1, True, True, 1 << 20, 0)',
    'token_filtered_backward radius 0':
        'P.token_filtered_backward(z(1, 3, 5, 3), None, z(3, 4), '
        'e(1, 3, 5, 4), 0, False, True, 1 << 20, 0)',
    'filtered_conv2d 1-d weight':
        'P.filtered_conv2d(z(1, 2, 4, 4), z(2), None, [1, 1], [0, 0], '
        '[1, 1], 1, 2, 0, 2, 0, 2)',
    # output pool
    'empty_for_writing negative size':
        'P.empty_for_writing([2, -1], torch.float32)',
    'empty_for_writing overflowing size':
        'P.empty_for_writing([1 << 40, 1 << 40], torch.float32)',
    'recycle_limit negative': 'P.recycle_limit(-1)',
    # bit masks
    'pack_mask non-contiguous': 'B.pack_mask(z(4, 4).t(), 0., 1., False)',
    'pack_mask integer': 'B.pack_mask(z(8, dtype=torch.int32), 0., 1., '
                         'False)',
    'apply_mask too few bits':
        'B.apply_mask(z(17), z(2, dtype=torch.uint8), 0.)',
    'apply_mask bits not uint8': 'B.apply_mask(z(16), z(2), 0.)',
    'apply_mask out of other shape':
        'B.apply_mask(z(16), z(2, dtype=torch.uint8), 0., e(15))',
    'apply_mask out of other dtype':
        'B.apply_mask(z(16), z(2, dtype=torch.uint8), 0., '
        'e(16, dtype=torch.float64))',
    # resized_cross_entropy(logits, label, weight, ignore_index,
    #   align_corners, want_grad, want_pixels, sigmoid)
    'resized loss zero classes':
        'L.resized_cross_entropy(z(1, 0, 2, 2), z(1, 4, 4, dtype=torch.long),'
        ' None, 255, False, True, False, False)',
    'resized loss zero-sized label map':
        'L.resized_cross_entropy(z(1, 3, 2, 2), z(1, 0, 4, dtype=torch.long),'
        ' None, 255, False, True, False, False)',
    'resized loss batch mismatch':
        'L.resized_cross_entropy(z(2, 3, 2, 2), z(1, 4, 4, dtype=torch.long),'
        ' None, 255, False, True, False, False)',
    'resized loss weight of other shape':
        'L.resized_cross_entropy(z(1, 3, 2, 2), z(1, 4, 4, dtype=torch.long),'
        ' z(1, 4, 3), 255, False, True, False, False)',
    'resized loss float64 logits':
        'L.resized_cross_entropy(z(1, 3, 2, 2, dtype=torch.float64), '
        'z(1, 4, 4, dtype=torch.long), None, 255, False, True, False, False)',
    'resized loss int32 label':
        'L.resized_cross_entropy(z(1, 3, 2, 2), z(1, 4, 4, dtype=torch.int),'
        ' None, 255, False, True, False, False)',
    'resized loss label out of range':
        'L.resized_cross_entropy(z(1, 3, 2, 2), '
        'torch.full((1, 4, 4), 3, dtype=torch.long), None, 255, False, True,'
        ' False, False)',
}

# Zero-sized batches or channels where the result is well defined: these
# must run and return what torch computes (checked in the child).
ACCEPTED = {
    'patch_sums empty batch':
        ('P.patch_sums(z(0, 2, 4, 4), 0, 2, 2, 0, 2, 2, False)',
         'r.shape == (0, 2, 2, 2)'),
    'spread no channels':
        ('P.spread(z(1, 0, 2, 2), 4, 4, 0, 2, 0, 2)', 'r.shape == (1, 0, 4, 4)'),
    'spread grid starting past the map':
        ('P.spread(torch.ones(1, 1, 2, 2), 4, 4, 10, 2, 10, 2)',
         'r.shape == (1, 1, 4, 4) and float(r.abs().sum()) == 0'),
    'patch_sums patches starting past the map':
        ('P.patch_sums(torch.ones(1, 1, 4, 4), 10, 2, 3, 10, 2, 3, False)',
         'r.shape == (1, 1, 3, 3) and float(r.abs().sum()) == 0'),
    'bilinear empty batch':
        ('P.bilinear_backward(z(0, 2, 4, 4), e(0, 2, 2, 2), False, -1., -1.)',
         'r is None and True'),
    'bilinear extreme scale':
        ('P.bilinear_backward(torch.ones(1, 1, 4, 4), e(1, 1, 2, 2), False, '
         '1e-300, 1e-300)', 'r is None and True'),
    'pack_mask empty': ('B.pack_mask(z(0), 0., 1., False)', 'r.numel() == 0'),
    'resized loss empty batch':
        ('L.resized_cross_entropy(z(0, 3, 2, 2), z(0, 4, 4, dtype=torch.long),'
         ' None, 255, False, True, False, False)', 'r[0].shape == (0,)'),
}

CHILD = r'''
import json, sys
import torch
from mmseg_gf import _patch_ops as P, _bit_mask as B, _resized_loss as L
e, z = torch.empty, torch.zeros
refused, accepted = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for name, expr in refused.items():
    try:
        eval(expr)
        outcome = 'no error'
    except RuntimeError as error:
        outcome = 'RuntimeError: ' + str(error).splitlines()[0]
    except Exception as error:
        outcome = f'{type(error).__name__}: {error}'
    print(json.dumps(['refused', name, outcome]), flush=True)
for name, (expr, check) in accepted.items():
    try:
        r = eval(expr)
        outcome = 'ok' if eval(check) else f'wrong result {r!r}'
    except Exception as error:
        outcome = f'{type(error).__name__}: {error}'
    print(json.dumps(['accepted', name, outcome]), flush=True)
'''


def test_every_entry_point_checks_its_arguments():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (REPO, os.environ.get('PYTHONPATH')) if p),
        OMP_NUM_THREADS='1')
    proc = subprocess.run(
        [sys.executable, '-c', CHILD, json.dumps(REFUSED),
         json.dumps(ACCEPTED)], capture_output=True, text=True, env=env,
        timeout=300, cwd=REPO)
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    last = lines[-1][1] if lines else 'none'
    assert proc.returncode == 0, (
        f'child died with {proc.returncode} after case {last!r}: '
        f'{proc.stderr[-2000:]}')
    seen = {name: outcome for _, name, outcome in lines}
    assert set(seen) == set(REFUSED) | set(ACCEPTED)
    wrong = {n: seen[n] for n in REFUSED
             if not seen[n].startswith('RuntimeError')}
    wrong.update({n: seen[n] for n in ACCEPTED if seen[n] != 'ok'})
    assert not wrong, wrong


def test_python_wrappers_keep_empty_tensors_off_the_kernels():
    """``conv_cpu.usable`` routes empty tensors to the PyTorch path, which
    the kernels would refuse."""
    import torch
    assert not conv_cpu.usable(torch.zeros(0, 2, 4, 4))
    assert conv_cpu.usable(torch.zeros(1, 2, 4, 4)) == availability.native_available()
