"""tools/plot_results.py: the README's figure, drawn again from a protocol
run's results.csv (the reduced CPU protocol's measured table)."""
import csv
from pathlib import Path

import pytest

pytest.importorskip('mmseg')
pytest.importorskip('matplotlib')

from mmseg_gf.protocol import report  # noqa: E402
from tests.helpers.tools import load_tool  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / 'docs' / 'protocol_cpu' / 'results.csv'


def test_the_tool_draws_the_measured_table(tmp_path, capsys):
    out = tmp_path / 'fig' / 'miou.png'
    assert load_tool('plot_results').main(
        [str(RESULTS), '--out', str(out), '--title', 't']) == 0
    assert out.stat().st_size > 1000
    assert capsys.readouterr().out.strip() == str(out)


def test_the_plot_takes_each_row_of_the_table(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(report, '_plot_points',
                        lambda path, title, points: seen.extend(points))
    report.plot_results_csv(str(RESULTS), str(tmp_path / 'x.png'), '')
    with open(RESULTS, newline='') as f:
        rows = list(csv.DictReader(f))
    assert [(p[1], p[3], p[5]) for p in seen] == [
        (r['method'], float(r['gflops']), float(r['mIoU_mean']))
        for r in rows]
    assert {p[0] for p in seen} == {'calib', 'vanilla', 'gf'}
