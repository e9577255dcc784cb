"""The paper's protocol (tools/run_protocol.py) through the whole command
with tiny settings, one model per decode-head type (PSPHead: the learning
run in test_protocol.py)."""
import os
import os.path as osp
import subprocess
import sys

import pytest

pytest.importorskip('mmseg')
torch = pytest.importorskip('torch')

from tests.helpers.protocol_results import (check_table,  # noqa: E402
                                            load_state)
from tests.helpers.tools import REPO, load_tool  # noqa: E402

TOOL = osp.join(REPO, 'tools', 'run_protocol.py')
run_protocol = load_tool('run_protocol')


# ----------------------------------------------- one model per head type
HEADS = [
    # (model, transfer, strategies, through the CLI subprocess)
    ('upernet_r18', 'ade2voc', ['calib', 'vanilla_all', 'gf_ref10'], True),
    ('deeplabv3_mv2', 'ade2cityscapes',
     ['calib', 'vanilla_last5', 'gf_last10_auto'], False),
    ('fcn_r18', 'ade2voc', ['calib', 'gf_last10_r2', 'gf_ref10'], False),
]


@pytest.mark.parametrize('model,transfer,strategies,cli', HEADS,
                         ids=[h[0] for h in HEADS])
def test_pipeline_per_head_type(tmp_path, model, transfer, strategies, cli):
    """UPerHead / ASPPHead (MobileNetV2, decoder calibration) / FCNHead
    through the whole command with tiny settings (PSPHead: the learning
    run above)."""
    out = str(tmp_path / 'wd')
    argv = [
        '--model', model, '--transfer', transfer, '--synthetic',
        str(tmp_path / 'data'), '--synthetic-train', '6', '--synthetic-val',
        '2', '--batch-size', '2', '--num-workers', '0', '--source-iters',
        '2', '--calib-iters', '2', '--finetune-iters', '2', '--val-interval',
        '2', '--seeds', '233', '--work-dir', out, '--cfg-options', 'model.decode_head.channels=32',
        '--strategies'
    ] + strategies
    if cli:
        env = dict(os.environ)
        env['PYTHONPATH'] = os.pathsep.join(
            p for p in (REPO, env.get('PYTHONPATH')) if p)
        proc = subprocess.run([sys.executable, TOOL] + argv, cwd=str(tmp_path),
                              env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stdout[-4000:]
        assert '| Method | Strategy |' in proc.stdout  # table printed
        assert '[protocol] [4/4]' in proc.stdout  # progress shown
    else:
        run_protocol.main(argv)
    rows = check_table(out, strategies)
    src = load_state(osp.join(out, 'source', 'iter_2.pth'))
    cal = load_state(osp.join(out, 'calib', 'iter_2.pth'))
    stem = ('backbone.conv1.conv.weight' if model == 'deeplabv3_mv2' else
            'backbone.stem.0.weight')
    assert torch.equal(src[stem], cal[stem])  # backbone frozen
    head = dict(upernet_r18='decode_head.fpn_bottleneck.conv.weight',
                deeplabv3_mv2='decode_head.bottleneck.conv.weight',
                fcn_r18='decode_head.conv_cat.conv.weight')[model]
    # Calibration trains the classifier only, except for MobileNetV2: the
    # whole decoder.
    assert torch.equal(src[head], cal[head]) == (model != 'deeplabv3_mv2')
    if model == 'deeplabv3_mv2':
        assert rows['gf_last10_auto']['layers'] == '10'
        assert rows['vanilla_last5']['method'] == 'Vanilla BP'
    if model == 'upernet_r18':
        assert rows['gf_ref10']['layers'] == '8'
        assert rows['gf_ref10']['radius'] == '2/4/8'
        assert rows['vanilla_all']['layers'] == 'All'
        assert float(rows['vanilla_all']['gflops']) > 100 * float(
            rows['gf_ref10']['gflops'])
    if model == 'fcn_r18':
        # The reference's FCN "10 layers" are the last 10 convs.
        assert rows['gf_ref10']['gflops'] == rows['gf_last10_r2']['gflops']
