"""2-process DDP through the real entry point: ``python -m
torch.distributed.run --nproc_per_node=2 tools/train.py CFG --launcher
pytorch`` (mmengine's launcher), gloo on CPU, both ways in (config rewrite
and an unchanged config + GradFilterHook). Each is compared with a
single-process run of the same total batch."""
import os
import os.path as osp
import socket
import subprocess
import sys

import pytest
import torch

from tests.helpers.engine_fixtures import (
    EXPECTED, changed_modules, prepare_workspace, tool_cfg, write_cfg)
from tests.helpers.tools import REPO, load_tool

PSP5 = set(EXPECTED['pspnet_r18'][5]) | {'decode_head.conv_seg'}
ITERS = 3


@pytest.fixture(scope='module')
def workspace(tmp_path_factory):
    return prepare_workspace(str(tmp_path_factory.mktemp('gf_ddp')))


def _config(workspace, tmp_path, way):
    out = tmp_path / way
    out.mkdir()
    cfg = tool_cfg(str(out / 'work'), workspace['voc'], workspace['init'],
                   way=way, max_iters=ITERS, batch_size=2)
    # mmseg's default: what a GPU config says. tools/train.py must switch
    # to gloo and a CPU DDP wrapper on a machine without CUDA.
    cfg['env_cfg']['dist_cfg'] = dict(backend='nccl')
    cfg['custom_hooks'].append(dict(type='StateDumpHook', out=str(out)))
    cfg['default_hooks']['checkpoint']['interval'] = 10**6
    return write_cfg(str(out / f'{way}.py'), cfg), out


def _torchrun(cfg_path, work_dir):
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS='1',
               PYTHONPATH=os.pathsep.join(
                   p for p in (REPO, os.environ.get('PYTHONPATH')) if p))
    cmd = [
        sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node=2',
        f'--master_port={port}',
        osp.join(REPO, 'tools', 'train.py'), cfg_path, '--launcher',
        'pytorch', '--work-dir', work_dir,
        # 2 ranks x 1 image = the single-process batch of 2
        '--cfg-options', 'train_dataloader.batch_size=1'
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout + proc.stderr


def _single(cfg_path, work_dir, monkeypatch):
    monkeypatch.delenv('LOCAL_RANK', raising=False)
    runner = load_tool('train').main([cfg_path, '--work-dir', work_dir])
    state = runner.model.state_dict()
    return {k: v.detach().clone() for k, v in state.items()}


@pytest.mark.ddp
@pytest.mark.parametrize('way', ['rewrite', 'hook'])
def test_ddp_tools_train_matches_single_process(workspace, tmp_path,
                                                monkeypatch, way):
    """Ranks end with identical parameters, only the 5 selected convs and
    the classifier change, and the result equals (float tolerance) one
    process with the same total batch: DDP averages the two ranks'
    gradients of the filtered backward exactly as one batch of 2 would."""
    cfg_path, out = _config(workspace, tmp_path, way)
    log = _torchrun(cfg_path, str(out / 'work_ddp'))
    ranks = [torch.load(osp.join(out, f'rank{r}.pth'))
             for r in (0, 1)]
    for info in ranks:
        assert info['world_size'] == 2 and info['backend'] == 'gloo'
        assert info['wrapper'] == 'CPUDistributedDataParallel'
        assert info['gf_paths'] == EXPECTED['pspnet_r18'][5]
        assert info['lean']['activation'] > 0 and info['lean']['loss'] == 1
        assert info['iter'] == ITERS
    for key, value in ranks[0]['state'].items():
        assert torch.equal(value, ranks[1]['state'][key]), key
    assert changed_modules(ranks[0]['state'],
                           workspace['init_state']) == PSP5
    assert 'Gradient filter (gf): 5 layers' in log  # the cost table
    assert 'Kept for backward by the whole step' in log

    single = _single(cfg_path, str(out / 'work_single'), monkeypatch)
    info = torch.load(osp.join(out, 'rank0.pth'))
    assert info['world_size'] == 1  # the dump now comes from one process
    assert changed_modules(single, workspace['init_state']) == PSP5
    for key, value in single.items():
        torch.testing.assert_close(ranks[0]['state'][key], value, rtol=1e-4,
                                   atol=1e-6, msg=key)
    # ... and the runs did move the weights well beyond that tolerance
    moved = single['decode_head.bottleneck.conv.weight'] - \
        workspace['init_state']['decode_head.bottleneck.conv.weight']
    assert moved.abs().max() > 1e-4


#: A config of mmseg's zoo as it comes (SyncBN everywhere, an auxiliary
#: head, Cityscapes): only the data, the schedule and the downloads change.
ZOO_CONFIG = 'pspnet/pspnet_r18-d8_4xb2-80k_cityscapes-512x1024.py'


def _zoo_config(tmp_path, out):
    from mmseg_gf.datasets.synthetic import make_cityscapes
    from mmseg_gf.engine.zoo import mmseg_config_dir
    base = osp.join(mmseg_config_dir(), ZOO_CONFIG)
    assert osp.isfile(base), base
    data = make_cityscapes(str(tmp_path / 'cityscapes'), num_train=2,
                           num_val=0, size=(64, 64))
    pipeline = [dict(type='LoadImageFromFile'), dict(type='LoadAnnotations'),
                dict(type='PackSegInputs')]
    text = f'''_base_ = [{base!r}]
custom_imports = dict(imports=['mmseg_gf', 'tests.helpers.train_hooks'],
                      allow_failed_imports=False)
custom_hooks = [dict(type='GradFilterHook', num_layers=5, radius=4),
                dict(type='StateDumpHook', out={str(out)!r})]
model = dict(pretrained=None, data_preprocessor=dict(size=(64, 64)),
             decode_head=dict(dropout_ratio=0.0))
train_dataloader = dict(batch_size=1, num_workers=0,
                        persistent_workers=False,
                        dataset=dict(data_root={data!r},
                                     pipeline={pipeline!r}))
train_cfg = dict(max_iters=2, val_interval=10**6)
val_cfg = None
val_dataloader = None
val_evaluator = None
test_cfg = None
test_dataloader = None
test_evaluator = None
default_hooks = dict(logger=dict(interval=1),
                     checkpoint=dict(interval=10**6))
'''
    path = tmp_path / 'zoo_hook.py'
    path.write_text(text)
    return str(path)


@pytest.mark.ddp
def test_ddp_zoo_config_with_syncbn_and_the_hook(tmp_path):
    """An unchanged zoo config (SyncBN) plus GradFilterHook, 2 processes
    on CPU: SyncBN becomes BN (one log line), both ranks train the same
    last 5 convs and end with identical parameters."""
    out = tmp_path / 'out'
    out.mkdir()
    log = _torchrun(_zoo_config(tmp_path, out), str(tmp_path / 'work'))
    assert 'SyncBatchNorm layers reverted to BatchNorm' in log
    assert 'SyncBatchNorm layers only work with GPU modules' not in log
    ranks = [torch.load(osp.join(out, f'rank{r}.pth')) for r in (0, 1)]
    for info in ranks:
        assert info['world_size'] == 2 and info['backend'] == 'gloo'
        assert info['wrapper'] == 'CPUDistributedDataParallel'
        assert len(info['gf_paths']) == 5 and info['iter'] == 2
        assert info['lean']['norm'] > 0
    for key, value in ranks[0]['state'].items():
        assert torch.equal(value, ranks[1]['state'][key]), key
