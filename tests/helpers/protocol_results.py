"""Reading a protocol run's results (tools/run_protocol.py): its tables
and checkpoints, checked for real numbers."""
import csv
import math
import os.path as osp

import torch


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def load_state(path):
    return torch.load(path, map_location='cpu')['state_dict']


def check_table(out_dir, strategies):
    """results.md / .csv / runs.csv / .png exist and hold numbers."""
    rows = {r['strategy']: r for r in read_csv(osp.join(out_dir,
                                                        'results.csv'))}
    assert list(rows) == strategies
    for name, r in rows.items():
        assert int(r['n_seeds']) >= 1, name
        for key in ('mIoU_mean', 'mAcc_mean', 'best_mIoU_mean'):
            v = float(r[key])
            assert 0.0 <= v <= 100.0 and not math.isnan(v), (name, key)
        assert float(r['best_mIoU_mean']) >= float(r['mIoU_mean'])
        if name == 'calib':
            assert (r['method'], r['layers'], float(r['gflops'])) == (
                'Calibration', '0', 0.0)
        elif name == 'classifier_only':
            assert (r['method'], r['layers'], float(r['gflops'])) == (
                'Classifier only', '0', 0.0)
        else:
            assert float(r['gflops']) > 0
    with open(osp.join(out_dir, 'results.md')) as f:
        md = f.read()
    assert '| Method | Strategy | #Layers | r | GFLOPs | mIoU | mAcc |' in md
    for name in strategies:
        line = next(ln for ln in md.splitlines()
                    if ln.startswith('| ') and f'| {name} |' in ln)
        # mean [std] cells with real numbers
        assert f'{float(rows[name]["mIoU_mean"]):.2f} [' in line
    assert osp.getsize(osp.join(out_dir, 'results.png')) > 1000
    runs = read_csv(osp.join(out_dir, 'runs.csv'))
    assert {r['strategy'] for r in runs} == set(strategies)
    return rows
