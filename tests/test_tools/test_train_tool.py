"""tools/train.py and tools/test.py in process: interrupt + ``--resume``
equals an uninterrupted run; bad input fails before training with a message
naming the setting and what is allowed; checkpoints of other models are
refused."""
import logging
import os
import os.path as osp
import re

import pytest
import torch
from mmengine.hooks import Hook
from mmseg.registry import HOOKS

from mmseg_gf.engine.checkpoint import check_checkpoint_matches
from tests.helpers.engine_fixtures import (
    EXPECTED, NORM, build_model, changed_modules, gf_paths, model_cfg,
    prepare_workspace, tool_cfg, write_cfg)
from tests.helpers.tools import REPO, load_tool
from tests.helpers.train_hooks import SimulatedInterrupt

PSP5 = set(EXPECTED['pspnet_r18'][5]) | {'decode_head.conv_seg'}


@pytest.fixture
def tools(monkeypatch):
    """tools/train.py and tools/test.py as modules; the environment they
    touch (LOCAL_RANK, the checkpoint allow-list) is restored afterwards."""
    monkeypatch.delenv('LOCAL_RANK', raising=False)
    return load_tool('train'), load_tool('test')


@HOOKS.register_module(force=True)
class IterRecordHook(Hook):
    """Records which iterations ran (class-level, for in-process runs)."""
    seen = []

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        IterRecordHook.seen.append(runner.iter)


@pytest.fixture(scope='module')
def workspace(tmp_path_factory):
    ws = prepare_workspace(str(tmp_path_factory.mktemp('gf_tool')))
    torch.manual_seed(0)
    other = build_model('deeplabv3_r18')
    ws['other'] = osp.join(ws['root'], 'deeplabv3_init.pth')
    torch.save({'state_dict': other.state_dict(), 'meta': {}}, ws['other'])
    return ws


def _cfg(workspace, tmp_path, name, **kwargs):
    cfg = tool_cfg(str(tmp_path / name), workspace['voc'], workspace['init'],
                   **kwargs)
    cfg['custom_hooks'].append(dict(type='IterRecordHook'))
    return cfg


def _checkpoints(work_dir):
    if not osp.isdir(work_dir):
        return []
    return sorted(f for f in os.listdir(work_dir) if f.endswith('.pth'))


# ----------------------------------------------------------------------------
# The lean region through the tool, with --amp (bf16 autocast on CPU)


@pytest.mark.parametrize('way', ['rewrite', 'hook'])
def test_lean_and_plain_runs_agree_under_amp(workspace, tmp_path, tools,
                                             way):
    """``lean`` (the default) and ``lean=False`` train the same weights
    through tools/train.py --amp, by the config rewrite and by the hook on
    an unchanged config; only the lean run has lean modules."""
    from mmseg_gf.engine.lean_region import lean_counts
    train, _ = tools
    states = {}
    for lean in (True, False):
        name = f'{way}_{"lean" if lean else "plain"}'
        cfg = _cfg(workspace, tmp_path, name, way=way, max_iters=2,
                   lean=lean)
        runner = train.main([write_cfg(str(tmp_path / f'{name}.py'), cfg),
                             '--work-dir', str(tmp_path / name), '--amp'])
        assert type(runner.optim_wrapper).__name__ == 'CPUAmpOptimWrapper'
        counts = lean_counts(runner.model)
        assert (counts.get('loss') == 1) == lean, counts
        states[lean] = {k: v.clone()
                        for k, v in runner.model.state_dict().items()}
    init = workspace['init_state']
    assert changed_modules(states[True], init) == PSP5
    for key, value in states[False].items():
        if value.is_floating_point():
            # the updates agree to bfloat16 rounding (8 significant bits)
            want, got = value - init[key], states[True][key] - init[key]
            torch.testing.assert_close(
                got, want, rtol=0, atol=2e-2 * float(want.abs().max()),
                msg=key)


# ----------------------------------------------------------------------------
# Resume


def _random_draws(cfg, restore_state: bool) -> None:
    """Dropout in the head, random flips and photometric distortion in
    the pipeline, a seeded run: draws from torch's and numpy's
    generators every iteration."""
    cfg['model']['decode_head']['dropout_ratio'] = 0.3
    pipeline = cfg['train_dataloader']['dataset']['pipeline']
    pipeline[-1:-1] = [dict(type='RandomFlip', prob=0.5),
                       dict(type='PhotoMetricDistortion')]
    cfg['randomness'] = dict(seed=3)
    if not restore_state:  # the rewrite keeps the user's hook arguments
        cfg['custom_hooks'].append(
            dict(type='GradFilterHook', resume_random_state=False))


def _resumed_runs(workspace, tmp_path, train, draws):
    """An uninterrupted 4-iteration run and one interrupted after
    iteration 2 and resumed with --resume: their final states."""
    cfg = _cfg(workspace, tmp_path, 'unused', max_iters=4)
    cfg['param_scheduler'] = [
        dict(type='CosineAnnealingLR', T_max=4, eta_min=0.0, begin=0, end=4,
             by_epoch=False)
    ]
    cfg['default_hooks']['checkpoint']['interval'] = 2
    if draws is not None:
        _random_draws(cfg, draws == 'restored')
    plain = write_cfg(str(tmp_path / 'plain.py'), cfg)
    cfg['custom_hooks'].append(dict(type='InterruptHook', at_iter=2))
    killed = write_cfg(str(tmp_path / 'killed.py'), cfg)

    # uninterrupted; --resume with nothing to resume starts from load_from
    IterRecordHook.seen = []
    full = train.main([plain, '--work-dir', str(tmp_path / 'full'),
                       '--resume'])
    assert IterRecordHook.seen == [0, 1, 2, 3]
    full_state = {k: v.clone() for k, v in full.model.state_dict().items()}
    assert changed_modules(full_state, workspace['init_state']) == PSP5

    work = str(tmp_path / 'interrupted')
    IterRecordHook.seen = []
    with pytest.raises(SimulatedInterrupt):
        train.main([killed, '--work-dir', work])
    assert IterRecordHook.seen == [0, 1]
    assert _checkpoints(work) == ['iter_2.pth']

    IterRecordHook.seen = []
    resumed = train.main([plain, '--work-dir', work, '--resume'])
    assert IterRecordHook.seen == [2, 3]  # continued, not restarted
    assert gf_paths(resumed.model) == EXPECTED['pspnet_r18'][5]
    state = resumed.model.state_dict()
    assert state.keys() == full_state.keys()
    return work, full_state, state


def test_resume_after_interrupt_equals_uninterrupted_run(
        workspace, tmp_path, tools):
    """A GF run killed after iteration 2 of 4 and restarted with --resume
    ends with the same weights as a run that was never interrupted (cosine
    lr, SGD momentum: scheduler and optimizer state are restored). The
    config's load_from (the pretrained init) must not be what --resume
    resumes from."""
    train, _ = tools
    work, full_state, state = _resumed_runs(workspace, tmp_path, train, None)
    for key, value in full_state.items():
        assert torch.equal(state[key], value), key
    saved = torch.load(osp.join(work, 'iter_4.pth'), map_location='cpu')
    assert all(torch.equal(saved['state_dict'][k], v)
               for k, v in full_state.items())


@pytest.mark.parametrize('draws', ['restored', 'not restored'])
def test_resume_with_dropout_and_random_augmentation(workspace, tmp_path,
                                                     tools, draws):
    """With dropout and random augmentations in a seeded run, the resumed
    weights equal the uninterrupted run's bit for bit: the loop replays the
    pipeline's numpy draws and the checkpoint puts torch's generator state
    back (``resume_random_state``). Without the state, dropout draws other
    masks after the resume and the trained weights differ."""
    train, _ = tools
    work, full_state, state = _resumed_runs(workspace, tmp_path, train,
                                            draws)
    saved = torch.load(osp.join(work, 'iter_2.pth'), map_location='cpu')
    assert ('random_state' in saved) == (draws == 'restored')
    differ = [k for k, v in full_state.items()
              if not torch.equal(state[k], v)]
    if draws == 'restored':
        assert differ == []
    else:
        assert differ and all(k.startswith(('decode_head', 'backbone.layer4'))
                              for k in differ), differ


# ----------------------------------------------------------------------------
# Bad input: fails before training, names the setting and what is allowed


def _conv_free_model():
    cfg = model_cfg('fcn_r18')
    cfg['backbone'] = dict(type='ConvFreeBackbone', channels=8)
    cfg['decode_head'] = dict(
        type='FCNHead', in_channels=8, in_index=0, channels=8, num_convs=0,
        concat_input=False, num_classes=3, norm_cfg=NORM,
        loss_decode=dict(type='CrossEntropyLoss', loss_weight=1.0))
    return cfg


BAD = {
    'not a dict': (dict(gradient_filter=5), ValueError,
                   r'gradient_filter must be a dict.*keys among'),
    'unknown key': (dict(gf=dict(radus=4)), ValueError,
                    r"unknown (key|argument)\(s\) \['radus'\]; allowed: "
                    r"\['num_layers'"),
    'num_layers 0': (dict(gf=dict(num_layers=0)), ValueError,
                     r'num_layers must be an int >= 1, got 0'),
    'num_layers str': (dict(gf=dict(num_layers='5')), ValueError,
                       r"num_layers must be an int >= 1, got '5'"),
    'num_layers too large': (
        dict(gf=dict(num_layers=28)), ValueError,
        r'num_layers must be an int in \[1, 27\].*got 28'),
    'radius 0': (dict(gf=dict(radius=0)), ValueError,
                 r"radius must be an int >= 1, 'auto' or a dict"),
    'radius float': (dict(gf=dict(radius=2.5)), ValueError,
                     r"radius must be an int >= 1, 'auto'.*got 2.5"),
    'radius dict': (dict(gf=dict(radius={'decode_head': -1})), ValueError,
                    r'radius must be an int >= 1'),
    'radius path typo': (
        dict(gf=dict(radius={'*': 2, 'decode_head.bottlenek': 8})),
        ValueError, r"radius: no module 'decode_head.bottlenek'.*"
        r"did you mean.*'decode_head.bottleneck'"),
    'classifier in layers': (
        dict(gf=dict(num_layers=None, layers=['decode_head.conv_seg'])),
        ValueError, r"'decode_head.conv_seg' is a decode head's "
        r'classifier'),
    'mode': (dict(gf=dict(mode='fast')), ValueError,
             r"mode must be one of \('gf', 'vanilla'\), got 'fast'"),
    'layer path': (dict(gf=dict(num_layers=None,
                                layers=['decode_head.botleneck'])),
                   ValueError, r"no module 'decode_head.botleneck'.*"
                   r"did you mean.*'decode_head.bottleneck'"),
    'load_from missing': (dict(load_from='/nonexistent/init.pth'),
                          FileNotFoundError,
                          r"load_from: checkpoint file "
                          r"'/nonexistent/init.pth' does not exist"),
    'load_from other model': (
        dict(load_from='OTHER'), ValueError,
        r"load_from: checkpoint '.*deeplabv3_init.pth' does not match the "
        r'EncoderDecoder.*keys the model does not have \[decode_head.'
        r'image_pool.*Only the classifiers'),
    'model without conv': (
        dict(model=_conv_free_model(), gf=dict(num_layers=1),
             load_from=None), ValueError,
        r"runs no layer of the kinds \['conv2d', 'linear', 'attention'\] on "
        r"its inference path that the output depends on besides its "
        r"classifiers \['decode_head.conv_seg'\]"),
}


@pytest.mark.parametrize('case,way', [
    (case, way) for case in sorted(BAD) for way in ('rewrite', 'hook')
    if not (case == 'not a dict' and way == 'hook')  # hook: keyword args
])
def test_bad_input_fails_before_training(workspace, tmp_path, tools, case,
                                         way):
    """Both ways in (config rewrite, unchanged config + GradFilterHook):
    the error comes before the first iteration and writes no checkpoint."""
    train, _ = tools
    change, error, message = BAD[case]
    cfg = _cfg(workspace, tmp_path, 'work', way=way,
               **change.get('gf', {}))
    settings = cfg.get('gradient_filter') or cfg['custom_hooks'][0]
    for key in [k for k, v in settings.items() if v is None]:
        settings.pop(key)  # e.g. layers= instead of num_layers=
    if 'gradient_filter' in change:
        cfg['gradient_filter'] = change['gradient_filter']
    if 'model' in change:
        cfg['model'] = change['model']
    if 'load_from' in change:
        cfg['load_from'] = {
            'OTHER': workspace['other']
        }.get(change['load_from'], change['load_from'])
    path = write_cfg(str(tmp_path / 'bad.py'), cfg)
    IterRecordHook.seen = []
    with pytest.raises(error, match=message):
        train.main([path, '--work-dir', str(tmp_path / 'work')])
    assert IterRecordHook.seen == []
    assert _checkpoints(str(tmp_path / 'work')) == []


def test_missing_config_file(tools, capsys):
    train, test = tools
    with pytest.raises(SystemExit):
        train.main(['/nonexistent/cfg.py'])
    assert "config: file '/nonexistent/cfg.py' does not exist" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        test.main([osp.join(REPO, 'configs', 'demo',
                            'pspnet_r18_voc_r4_cpu.py'), '/nonexistent.pth'])
    assert "checkpoint: file '/nonexistent.pth' does not exist" in \
        capsys.readouterr().err


def test_test_tool_refuses_a_checkpoint_of_another_model(
        workspace, tmp_path, tools):
    """tools/test.py: mmengine would load it with strict=False and evaluate
    random weights; here it fails before evaluating, listing mismatches."""
    _, test = tools
    cfg = tool_cfg(str(tmp_path / 'eval'), workspace['voc'], None)
    cfg.pop('gradient_filter')
    cfg.update(
        test_dataloader=dict(
            batch_size=1, num_workers=0,
            sampler=dict(type='DefaultSampler', shuffle=False),
            dataset=dict(cfg['train_dataloader']['dataset'],
                         ann_file='ImageSets/Segmentation/val.txt')),
        test_evaluator=dict(type='IoUMetric', iou_metrics=['mIoU']),
        test_cfg=dict(type='TestLoop'))
    path = write_cfg(str(tmp_path / 'eval.py'), cfg)
    with pytest.raises(ValueError,
                       match=r"checkpoint: checkpoint '.*deeplabv3_init.pth'"
                       r' does not match.*keys the model does not have'):
        test.main([path, workspace['other']])
    metrics = test.main([path, workspace['init']])  # the right one works
    assert 0 <= metrics['mIoU'] <= 100


def test_checkpoint_check_rules(workspace, tmp_path):
    """The load_from rule: classifiers may differ (a new dataset has other
    classes), with a warning; anything else is an error; DDP 'module.'
    prefixes are accepted as mmengine strips them."""
    from mmengine.logging import MMLogger
    model = build_model('pspnet_r18')
    state = torch.load(workspace['init'])['state_dict']

    def save(name, sd):
        path = str(tmp_path / name)
        torch.save({'state_dict': sd}, path)
        return path

    check_checkpoint_matches(model, workspace['init'])
    check_checkpoint_matches(
        model, save('ddp.pth', {'module.' + k: v for k, v in state.items()}))
    classes = dict(state)
    classes['decode_head.conv_seg.weight'] = torch.zeros(21, 128, 1, 1)
    classes['decode_head.conv_seg.bias'] = torch.zeros(21)
    classes['auxiliary_head.conv_seg.weight'] = torch.zeros(21, 64, 1, 1)
    logger = MMLogger.get_instance('gf_ckpt_check_test')
    messages = []

    class Collect(logging.Handler):

        def emit(self, record):
            messages.append(record.getMessage())

    logger.addHandler(Collect(level=logging.WARNING))
    check_checkpoint_matches(model, save('classes.pth', classes),
                             logger=logger)
    assert 'classifiers only' in str(messages) and \
        'decode_head.conv_seg.weight' in str(messages)
    renamed = {k.replace('backbone.', 'encoder.'): v
               for k, v in state.items()}
    with pytest.raises(ValueError, match=r'model keys missing from it '
                       r'\[backbone\.stem.*keys the model does not have '
                       r'\[encoder\.stem'):
        check_checkpoint_matches(model, save('renamed.pth', renamed))
    wide = dict(state)
    wide['decode_head.bottleneck.conv.weight'] = torch.zeros(64, 1024, 3, 3)
    with pytest.raises(ValueError, match=re.escape(
            'decode_head.bottleneck.conv.weight: checkpoint (64, 1024, 3, 3) '
            'vs model (128, 1024, 3, 3)')):
        check_checkpoint_matches(model, save('wide.pth', wide))
    with pytest.raises(ValueError, match='shape mismatches'):
        check_checkpoint_matches(model, save('classes2.pth', classes),
                                 setting='checkpoint', allowed=None)
