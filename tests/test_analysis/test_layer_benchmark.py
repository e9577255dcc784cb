"""The per-layer benchmark tool runs and measures what it claims."""
import json
import subprocess
import sys
from pathlib import Path

import torch

from mmseg_gf.analysis.layer_benchmark import summarize, time_layer
from tests.helpers.tools import REPO  # noqa: E402

ROOT = Path(REPO)


def test_time_layer_measures_both_cases_and_saved_bytes():
    rows = time_layer(8, 8, 16, 16, radii=(2, 4), batch=2, repeats=1,
                      warmup=0)
    assert {(r.case, r.radius) for r in rows} == {
        ('with_gx', 2), ('with_gx', 4), ('weight_only', 2),
        ('weight_only', 4)}
    for row in rows:
        assert row.vanilla_saved_bytes == 2 * 8 * 16 * 16 * 4
        assert row.gf_saved_bytes * row.radius**2 == row.vanilla_saved_bytes
        assert row.vanilla_backward > 0 and row.gf_backward > 0
    summary = summarize(rows)
    assert summary['with_gx/r=4']['max_saved_ratio'] == 1 / 16


def test_time_layer_bfloat16_and_io_floor():
    rows = time_layer(4, 4, 8, 8, radii=(2, ), batch=1, repeats=1, warmup=0,
                      dtype=torch.bfloat16)
    assert [(r.case, r.dtype) for r in rows] == [('with_gx', 'bfloat16'),
                                                 ('weight_only', 'bfloat16')]
    for row in rows:
        assert row.io_floor > 0 and row.grad_clone > 0
        assert row.vanilla_saved_bytes == 4 * 8 * 8 * 2  # bfloat16 x


def test_cli_writes_json_markdown_and_plot(tmp_path):
    out = tmp_path / 'bench'
    subprocess.run(
        [sys.executable, 'tools/benchmark_layers.py', '--layers', '6',
         '--batch', '1', '--repeats', '1', '--warmup', '0', '--radii', '4',
         '--device', 'cpu', '--dtype', 'float32', '--out-dir', str(out)],
        cwd=ROOT, check=True, capture_output=True, timeout=300)
    data = json.loads((out / 'layers.json').read_text())
    assert len(data['rows']) == 2  # with_gx and weight_only at r=4
    assert data['rows'][0]['layer'] == '64x64@56x56'
    assert data['meta']['dtype'] == 'float32'
    assert data['rows'][0]['backward_over_io_floor'] > 0
    assert '| 64x64@56x56 |' in (out / 'layers.md').read_text()
    assert (out / 'layers.png').stat().st_size > 1000


def test_time_linear_layer_windows_and_saved_bytes():
    from mmseg_gf.analysis.layer_benchmark import (LinearShape,
                                                   time_linear_layer)
    shape = LinearShape('tiny swin', 8, 8, 4, 6, window=4)  # 4 windows
    rows = time_linear_layer(shape, radii=(2, 4), batch=2, repeats=1,
                             warmup=0, clock='thread')
    assert {(r.case, r.radius, r.kind) for r in rows} == {
        (c, r, 'linear') for c in ('with_gx', 'weight_only') for r in (2, 4)}
    x_bytes = 2 * 4 * 16 * 4 * 4  # batch x windows x tokens x C x float32
    for row in rows:
        # GF keeps x's patch sums only: 1/r^2 of x (vanilla: x, and W for
        # g_x, counted or not by the saved-tensor hooks)
        assert row.gf_saved_bytes == x_bytes // row.radius**2
        assert row.vanilla_saved_bytes >= x_bytes
    summary = summarize(rows)
    assert set(summary) == {'linear/with_gx/r=2', 'linear/with_gx/r=4',
                            'linear/weight_only/r=2',
                            'linear/weight_only/r=4'}


def test_cli_linear_kind_with_thread_clock(tmp_path):
    out = tmp_path / 'bench'
    subprocess.run(
        [sys.executable, 'tools/benchmark_layers.py', '--kinds', 'linear',
         '--linear-layers', '1', '--batch', '1', '--repeats', '1',
         '--warmup', '0', '--radii', '2', '--device', 'cpu', '--threads',
         '1', '--clock', 'thread', '--out-dir', str(out)],
        cwd=ROOT, check=True, capture_output=True, timeout=300)
    data = json.loads((out / 'layers.json').read_text())
    assert data['meta']['clock'] == 'thread'
    assert [r['layer'] for r in data['rows']] == [
        'linear segformer-b2 s1 kv (sr 8) 64x128'] * 2
    assert set(data['summary']['cpu']) == {'linear/with_gx/r=2',
                                           'linear/weight_only/r=2'}
