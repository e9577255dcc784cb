"""End to end: tools/make_dataset.py -> tools/train.py (the CPU demo config,
a few iterations) -> tools/test.py on the checkpoint, as subprocesses."""
import json
import os
import os.path as osp
import subprocess
import sys

import pytest
from tests.helpers.tools import REPO  # noqa: E402

pytest.importorskip('mmseg')

DEMO_CFG = osp.join(REPO, 'configs', 'demo', 'pspnet_r18_voc_r4_cpu.py')
ITERS = 4


def run(args, cwd):
    """Run a repo tool with the repo importable, as `make` would."""
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join(
        p for p in (REPO, env.get('PYTHONPATH')) if p)
    proc = subprocess.run([sys.executable] + args, cwd=cwd, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    """A tiny synthetic VOC12Aug and a checkpoint trained on it for ITERS
    iterations by the demo config (gradient filter on)."""
    tmp = tmp_path_factory.mktemp('cli')
    # The demo config reads data/demo/... relative to the working dir, as in
    # `make demo`; here the working dir is tmp.
    out = run([
        osp.join(REPO, 'tools', 'make_dataset.py'), 'voc', '--out',
        'data/demo', '--num-train', '8', '--num-val', '4', '--size', '48',
        '64', '--classes', '1', '2', '3'
    ], cwd=str(tmp))
    assert 'written to' in out
    work_dir = tmp / 'work'
    log = run([
        osp.join(REPO, 'tools', 'train.py'), DEMO_CFG, '--work-dir',
        str(work_dir), '--cfg-options', f'train_cfg.max_iters={ITERS}',
        f'train_cfg.val_interval={ITERS}',
        f'default_hooks.checkpoint.interval={ITERS}',
        'default_hooks.logger.interval=1', 'train_dataloader.num_workers=0',
        'train_dataloader.persistent_workers=False',
        'val_dataloader.num_workers=0', f'param_scheduler.0.T_max={ITERS}',
        f'param_scheduler.0.end={ITERS}'
    ], cwd=str(tmp))
    return tmp, work_dir, log


def test_train_cli_filters_and_validates(trained):
    _, work_dir, log = trained
    # GradFilterHook's cost table names the 5 filtered convs.
    for path in ('decode_head.psp_modules.0.1.conv',
                 'decode_head.psp_modules.3.1.conv',
                 'decode_head.bottleneck.conv'):
        assert path in log
    assert f'Iter(train) [{ITERS}/{ITERS}]' in log
    assert 'mIoU' in log  # the validation at the end
    assert osp.isfile(osp.join(work_dir, f'iter_{ITERS}.pth'))


def test_test_cli_reports_miou(trained):
    tmp, work_dir, _ = trained
    ckpt = osp.join(work_dir, f'iter_{ITERS}.pth')
    eval_dir = tmp / 'eval'
    pred_dir = tmp / 'preds'
    out = run([
        osp.join(REPO, 'tools', 'test.py'), DEMO_CFG, ckpt, '--work-dir',
        str(eval_dir), '--out',
        str(pred_dir), '--cfg-options', 'test_dataloader.num_workers=0'
    ], cwd=str(tmp))
    assert 'mIoU' in out
    with open(eval_dir / 'metrics.json') as f:
        metrics = json.load(f)
    for key in ('aAcc', 'mIoU', 'mAcc'):
        assert 0.0 <= metrics[key] <= 100.0
    # --out: one predicted label map per val image.
    assert len(list(pred_dir.glob('*.png'))) == 4


def test_demo_runs_before_after(trained):
    """tools/demo.py end to end on tiny data and 2 iterations: too short to
    require a rise (exit status 0 or 1), but every step must run and the
    before/after table must be printed."""
    tmp, _, _ = trained
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join(
        p for p in (REPO, env.get('PYTHONPATH')) if p)
    proc = subprocess.run([
        sys.executable, osp.join(REPO, 'tools', 'demo.py'), '--work-dir',
        'demo_wd', '--data', 'data/demo', '--num-train', '4', '--num-val',
        '2', '--size', '48', '64', '--classes', '1', '2', '--cfg-options',
        'train_cfg.max_iters=2', 'train_cfg.val_interval=2',
        'default_hooks.checkpoint.interval=2',
        'train_dataloader.num_workers=0',
        'train_dataloader.persistent_workers=False',
        'val_dataloader.num_workers=0', 'test_dataloader.num_workers=0'
    ], cwd=str(tmp), env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode in (0, 1), out[-4000:]
    assert 'synthetic VOC12Aug written' in out  # settings differ: rewritten
    assert 'before (init)' in out and 'after finetune' in out
    assert 'mIoU change' in out
    assert osp.isfile(tmp / 'demo_wd' / 'iter_0.pth')
    with open(tmp / 'demo_wd' / 'after' / 'metrics.json') as f:
        assert 0.0 <= json.load(f)['mIoU'] <= 100.0
