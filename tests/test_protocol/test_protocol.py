"""The paper's protocol end to end (tools/run_protocol.py) on generated data:
source model trained offline -> calibration -> finetuning -> Table 3/9
layout; resumption; calibration / freezing semantics in the checkpoints;
configs composed from the bases; #Layers / GFLOPs against the reference
implementation's layer choices."""
import json
import math
import os
import os.path as osp

import pytest

pytest.importorskip('mmseg')
torch = pytest.importorskip('torch')

from mmengine.config import Config  # noqa: E402

from tests.helpers.protocol_results import (check_table,  # noqa: E402
                                            load_state)
from tests.helpers.tools import REPO, load_tool  # noqa: E402

run_protocol = load_tool('run_protocol')

from mmseg_gf.protocol import compose_config  # noqa: E402
from mmseg_gf.protocol.run_config import (rescale_schedule,  # noqa: E402
                                          set_data)
from mmseg_gf.protocol.flops import strategy_cost  # noqa: E402
from mmseg_gf.engine.hooks import ValMetricsRecorderHook  # noqa: E402
from mmseg_gf.protocol.report import mean_std  # noqa: E402


#: Small but real: the learning run (PSPNet-R18, Cityscapes -> VOC12Aug).
LEARN_ARGS = [
    '--model', 'pspnet_r18', '--transfer', 'cityscapes2voc',
    '--synthetic-train', '32', '--synthetic-val', '8', '--batch-size', '4',
    '--num-workers', '0', '--source-iters', '60', '--calib-iters', '60',
    '--finetune-iters', '100', '--val-interval', '50', '--seeds', '233'
]


# ------------------------------------------------------------ learning run
@pytest.fixture(scope='module')
def learned(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('pipeline_learn')
    out = str(tmp / 'wd')
    argv = LEARN_ARGS + [
        '--synthetic', str(tmp / 'data'), '--work-dir', out, '--strategies',
        'calib', 'classifier_only', 'gf_last5_r4'
    ]
    run_protocol.main(argv)
    return tmp, out, argv


def test_gf_last5_learns_beyond_calibration(learned):
    """GF finetuning of the last 5 layers (r=4) raises target mIoU well
    above calibration only, and above finetuning the classifier alone with
    the same schedule (so the filtered gradients of the 5 convs do the
    work, not just more classifier training). Same seed, same data."""
    _, out, _ = learned
    rows = check_table(out, ['calib', 'classifier_only', 'gf_last5_r4'])
    calib = float(rows['calib']['mIoU_mean'])
    clf = float(rows['classifier_only']['mIoU_mean'])
    gf = float(rows['gf_last5_r4']['mIoU_mean'])
    print(f'mIoU: calibration {calib:.2f}, classifier only {clf:.2f}, '
          f'GF last-5 r=4 {gf:.2f}')
    assert gf > calib + 20.0
    assert gf > clf + 10.0
    assert (rows['classifier_only']['method'], rows['classifier_only']
            ['layers']) == ('Classifier only', '0')
    assert rows['gf_last5_r4']['layers'] == '5'
    assert rows['gf_last5_r4']['radius'] == '4'
    # The validation history is recorded (every 50 of 100 iterations).
    with open(osp.join(out, 'gf_last5_r4', 'seed233', 'result.json')) as f:
        res = json.load(f)
    assert [r['iter'] for r in res['val']] == [50, 100]
    assert res['final']['iter'] == 100


def test_calibration_and_finetune_freeze_the_right_weights(learned):
    """Calibration changes only BN statistics and the classifier; GF
    finetuning changes only the chosen convs and the classifier."""
    _, out, _ = learned
    src = load_state(osp.join(out, 'source', 'iter_60.pth'))
    cal = load_state(osp.join(out, 'calib', 'iter_60.pth'))
    ft = load_state(osp.join(out, 'gf_last5_r4', 'seed233', 'iter_100.pth'))
    clf = load_state(
        osp.join(out, 'classifier_only', 'seed233', 'iter_100.pth'))
    for key in ('backbone.stem.0.weight', 'backbone.layer4.1.conv2.weight',
                'backbone.layer1.0.bn1.weight',
                'decode_head.bottleneck.conv.weight',
                'decode_head.bottleneck.bn.bias'):
        assert torch.equal(src[key], cal[key]), key
    for key in ('backbone.layer1.0.bn1.running_mean',
                'decode_head.bottleneck.bn.running_var'):
        assert not torch.allclose(src[key], cal[key]), key
    assert src['decode_head.conv_seg.weight'].shape[0] == 19
    assert cal['decode_head.conv_seg.weight'].shape[0] == 21
    # Finetuning: backbone and its BN statistics untouched ...
    for key in ('backbone.layer4.1.conv2.weight',
                'backbone.layer1.0.bn1.running_mean',
                'decode_head.bottleneck.bn.running_var'):
        assert torch.equal(cal[key], ft[key]), key
    # ... the 5 filtered convs and the classifier trained.
    for key in ('decode_head.bottleneck.conv.weight',
                'decode_head.psp_modules.3.1.conv.weight',
                'decode_head.conv_seg.weight'):
        assert not torch.equal(cal[key], ft[key]), key
    # Classifier only: nothing else moves, BN statistics included.
    for key, value in cal.items():
        if not key.startswith('decode_head.conv_seg'):
            assert torch.equal(value, clf[key]), key
    assert not torch.equal(cal['decode_head.conv_seg.weight'],
                           clf['decode_head.conv_seg.weight'])


def test_resume_after_interrupt_and_stale_runs(learned, monkeypatch,
                                               capsys):
    """Interrupt a new strategy mid-run: finished runs are not redone, the
    interrupted one resumes from its checkpoint (here in a new process,
    --isolate); a changed setting makes the
    affected runs stale."""
    _, out, argv = learned
    strategies = ['calib', 'classifier_only', 'gf_last5_r4']
    argv = [a for a in argv if a not in strategies]
    i = argv.index('--strategies') + 1
    argv[i:i] = strategies + ['vanilla_last5']
    done = {
        name: os.path.getmtime(osp.join(out, name, 'result.json'))
        for name in ('source', 'calib', 'gf_last5_r4/seed233')
    }
    original = ValMetricsRecorderHook.after_val_epoch

    def interrupting(self, runner, metrics=None):
        original(self, runner, metrics)
        if 'vanilla_last5' in runner.work_dir and runner.iter == 50:
            raise KeyboardInterrupt

    monkeypatch.setattr(ValMetricsRecorderHook, 'after_val_epoch',
                        interrupting)
    capsys.readouterr()
    with pytest.raises(KeyboardInterrupt):
        run_protocol.main(argv)
    log = capsys.readouterr().out
    assert '[1/1] vanilla_last5/seed233: starting' in log
    wd = osp.join(out, 'vanilla_last5', 'seed233')
    assert osp.isfile(osp.join(wd, 'iter_50.pth'))
    assert not osp.exists(osp.join(wd, 'result.json'))
    monkeypatch.setattr(ValMetricsRecorderHook, 'after_val_epoch', original)

    run_protocol.main(argv + ['--isolate'])
    log = capsys.readouterr().out
    assert 'partial vanilla_last5/seed233' in log
    assert '[1/1] vanilla_last5/seed233: resuming' in log
    for name, mtime in done.items():
        assert os.path.getmtime(osp.join(out, name, 'result.json')) == mtime
    with open(osp.join(wd, 'result.json')) as f:
        res = json.load(f)
    assert [r['iter'] for r in res['val']] == [50, 100]
    # The resumed half started at iteration 50 from the checkpoint.
    logs = ''.join(
        open(osp.join(root, name)).read()
        for root, _, files in os.walk(wd) for name in files
        if name.endswith('.log'))
    assert 'resumed epoch: 0, iter: 50' in logs
    rows = check_table(out, strategies + ['vanilla_last5'])
    assert rows['vanilla_last5']['method'] == 'Vanilla BP'
    assert rows['vanilla_last5']['layers'] == '5'
    assert float(rows['vanilla_last5']['gflops']) > 20 * float(
        rows['gf_last5_r4']['gflops'])

    # Nothing left to do: a plain re-run trains nothing.
    run_protocol.main(argv)
    log = capsys.readouterr().out
    assert 'starting' not in log and 'resuming' not in log
    # Another finetuning length: only the finetuning runs are stale.
    i = argv.index('--finetune-iters')
    changed = argv[:i + 1] + ['80'] + argv[i + 2:]
    run_protocol.main(changed + ['--dry-run'])
    plan = capsys.readouterr().out
    assert 'done    source' in plan and 'done    calib' in plan
    assert 'stale   gf_last5_r4/seed233' in plan
    assert 'stale   vanilla_last5/seed233' in plan


# ------------------------------------------------------ configs and costs
def test_rescale_schedule_keeps_shape():
    cfg = compose_config('pspnet_r18', 'voc', 'gf_last5_r4')
    assert cfg.train_cfg.max_iters == 20000
    warm, cos = cfg.param_scheduler
    assert (warm.type, warm.end, cos.type, cos.begin, cos.T_max) == (
        'LinearLR', 1000, 'CosineAnnealingLR', 1000, 19000)
    assert cfg.optim_wrapper.clip_grad.max_norm == 1
    assert cfg.model.backbone.norm_eval is True
    rescale_schedule(cfg, 100)
    warm, cos = cfg.param_scheduler
    assert (warm.begin, warm.end, cos.begin, cos.end, cos.T_max) == (
        0, 5, 5, 100, 95)
    assert cfg.train_cfg.val_interval == 10  # ten validations, as before
    assert cfg.default_hooks.checkpoint.interval == 10
    cal = compose_config('pspnet_mv2', 'cityscapes', 'calib')
    assert cal.train_cfg.max_iters == 5000
    hook = cal.custom_hooks[0]
    assert (hook.type, hook.trainable) == ('CalibrationHook',
                                           ['decode_head'])
    (exp, ) = cal.param_scheduler
    decay = exp.gamma**5000
    rescale_schedule(cal, 40, val_interval=40)
    assert math.isclose(cal.param_scheduler[0].gamma**40, decay,
                        rel_tol=1e-9)
    assert (cal.train_cfg.max_iters, cal.train_cfg.val_interval) == (40, 40)
    r18 = compose_config('fcn_r18', 'voc', 'calib')
    assert r18.custom_hooks[0].trainable == ['decode_head.conv_seg']
    assert r18.train_cfg.max_iters == 1000
    assert r18.train_dataloader.batch_size == 8


def _concrete(path):
    """(model, target, strategy) of a configs/{calib,gf} file, from its
    name (tests/helpers/config_names.py); pspnet_r18_voc_r4.py is the short
    name
    of pspnet_r18-d8_gf-last5-r4_1xb8-20k_voc12aug-512x512.py."""
    from tests.helpers.config_names import parse_config_name
    if osp.basename(path) == 'pspnet_r18_voc_r4.py':
        return 'pspnet_r18', 'voc', 'gf_last5_r4'
    model, target, strategy, _ = parse_config_name(path)
    kind = osp.basename(osp.dirname(path))
    assert (kind == 'calib') == (strategy == 'calib'), path
    return model, target, strategy


def test_concrete_configs_are_base_compositions():
    """Every configs/calib and configs/gf file is the pipeline's
    composition of model + dataset + runtime + strategy bases: the same
    ``_base_`` list and glue for all, and the very same config for a sample
    (loading is slow: mmengine resolves ``mmseg::`` bases through
    pkg_resources)."""
    import ast
    import glob

    from mmseg_gf.protocol.experiments import (PROTOCOL_DATASETS,
                                               PROTOCOL_MODELS, strategy_file)
    paths = sorted(
        glob.glob(osp.join(REPO, 'configs', 'calib', '*.py')) +
        glob.glob(osp.join(REPO, 'configs', 'gf', '*.py')))
    # calibration 6 models x 2 targets; GF and vanilla last 5 for the same;
    # 4 reference layer lists; the short-named entry point.
    assert len(paths) == 12 + 24 + 4 + 1
    base = osp.join(REPO, 'configs', '_base_')
    for path in paths:
        model, target, strategy = _concrete(path)
        with open(path) as f:
            tree = ast.parse(f.read())
        assigned = {
            node.targets[0].id: node.value
            for node in tree.body if isinstance(node, ast.Assign)
        }
        assert set(assigned) == {'_base_', 'model'}, path
        bases = [
            osp.normpath(osp.join(osp.dirname(path), b))
            for b in ast.literal_eval(assigned['_base_'])
        ]
        assert bases == [
            osp.join(base, 'models', PROTOCOL_MODELS[model].base),
            osp.join(base, 'datasets', PROTOCOL_DATASETS[target].base),
            osp.join(base, 'default_runtime.py'),
            strategy_file(strategy, model)
        ], path
    sample = ('calib/pspnet_m-v2-d8_calib_1xb8-5k_cityscapes-512x1024.py',
              'calib/fcn_r18-d8_calib_1xb8-1k_voc12aug-512x512.py',
              'gf/upernet_r18_gf-last5-r4_1xb8-20k_voc12aug-512x512.py',
              'gf/deeplabv3_r18-d8_gf-ref10_1xb8-20k_voc12aug-512x512.py',
              'gf/pspnet_r18_voc_r4.py')
    for rel in sample:
        path = osp.join(REPO, 'configs', rel)
        want = compose_config(*_concrete(path)).to_dict()
        assert Config.fromfile(path).to_dict() == want, path


def _cost(model, strategy):
    cfg = compose_config(model, 'voc', strategy)
    set_data(cfg, crop=(64, 64))
    return strategy_cost(cfg)


def test_last_n_selection_against_reference_choices():
    """#Layers / GFLOPs from the shared cost model: last-N + fixed r
    reproduces the reference's PSPNet-R18 and FCN-R18 choices exactly;
    for DeepLabV3 and UPerNet the differing convs are the documented ones
    (docs/protocol.md)."""
    psp = {s: _cost('pspnet_r18', s) for s in (
        'vanilla_all', 'vanilla_last10', 'vanilla_last5', 'gf_last5_r2',
        'gf_last5_r4', 'gf_last10_r4', 'gf_ref10')}
    g = {s: c['gflops'] for s, c in psp.items()}
    assert (g['vanilla_all'] > g['vanilla_last10'] > g['vanilla_last5'] >
            g['gf_last5_r2'] > g['gf_last5_r4'] > 0)
    assert psp['vanilla_all']['layers'] == 'All'
    assert psp['vanilla_last5']['radius'] == '-'
    paths = [p['path'] for p in psp['gf_last10_r4']['per_layer']]
    assert paths == [p['path'] for p in psp['gf_ref10']['per_layer']]
    assert g['gf_last10_r4'] == g['gf_ref10']

    dl_last = _cost('deeplabv3_r18', 'gf_last10_r4')
    dl_ref = _cost('deeplabv3_r18', 'gf_ref10')
    last = {p['path'] for p in dl_last['per_layer']}
    ref = {p['path']: p['radius'] for p in dl_ref['per_layer']}
    assert last - set(ref) == {'decode_head.image_pool.1.conv'}
    assert set(ref) - last == {'backbone.layer4.0.conv1'}
    assert ref['decode_head.aspp_modules.3.conv'] == 9
    assert ref['backbone.layer4.1.conv2'] == 2

    up_auto = _cost('upernet_r18', 'gf_last10_auto')
    up_ref = _cost('upernet_r18', 'gf_ref10')
    auto = {p['path']: p['radius'] for p in up_auto['per_layer']}
    ref = {p['path']: p['radius'] for p in up_ref['per_layer']}
    assert set(ref) - set(auto) == {
        'decode_head.lateral_convs.0.conv', 'decode_head.lateral_convs.1.conv'
    }
    assert set(auto) - set(ref) == {
        f'decode_head.psp_modules.{i}.1.conv' for i in range(4)
    }
    # Where both train a conv, 'auto' gives the reference's radius.
    for path in set(ref) & set(auto):
        assert auto[path] == ref[path], path


def test_mean_std_is_sample_std():
    assert mean_std([]) == (None, None)
    assert mean_std([3.0]) == (3.0, None)
    mean, std = mean_std([1.0, 2.0, 6.0])
    assert mean == 3.0 and math.isclose(std, math.sqrt(7.0))


def test_unknown_strategy_is_a_clean_error(tmp_path):
    with pytest.raises(SystemExit, match='no config for model'):
        run_protocol.main([
            '--model', 'deeplabv3_mv2', '--transfer', 'ade2voc',
            '--strategies', 'gf_ref10', '--work-dir', str(tmp_path),
            '--dry-run'
        ])
