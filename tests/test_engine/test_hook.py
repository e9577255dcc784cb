"""GradFilterHook on an unchanged mmseg config: single process, checkpoint
compatibility both ways (plain mmseg without the plugin, plain checkpoint
into a GF model), resume, the cost table. 2-process DDP: test_distributed.py.
"""
import os
import os.path as osp
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from mmengine.config import Config
from mmengine.logging import MMLogger

from mmseg_gf.accounting.report import chosen_layers_table
from mmseg_gf.engine import (GradFilterHook, apply_gradient_filter,
                             select_layers, trace_layers)
from mmseg_gf.models import GFConv2d
from tests.helpers.engine_fixtures import (
    EXPECTED, build_model, changed_modules, gf_paths, prepare_workspace,
    run_training, runner_cfg)
from tests.helpers.tools import REPO

INPUT = (64, 64)
PSP5 = set(EXPECTED['pspnet_r18'][5]) | {'decode_head.conv_seg'}


def _fake_runner(model):
    return SimpleNamespace(model=model, cfg=Config(dict(crop_size=INPUT)),
                           logger=MMLogger.get_current_instance())


def test_hook_settings_and_in_place_surgery():
    runner = _fake_runner(build_model('fcn_r18'))
    with pytest.raises(ValueError, match='GradFilterHook needs num_layers'):
        GradFilterHook().before_train(runner)
    with pytest.raises(ValueError, match='mode must be one of'):
        GradFilterHook(num_layers=2, mode='exact')
    with pytest.raises(ValueError, match='exactly one of num_layers'):
        GradFilterHook(num_layers=2, layers=['decode_head'])
    hook = GradFilterHook(num_layers=2, radius='auto')
    hook.before_train(runner)  # not wrapped: surgery in place
    assert gf_paths(runner.model) == EXPECTED['fcn_r18'][5][-2:]
    assert all(m.radius == 4 for m in runner.model.modules()
               if isinstance(m, GFConv2d))  # 1/8 -> 4
    runner.model.train()
    hook.before_train_iter(runner, 0)
    assert not runner.model.backbone.layer4[1].bn2.training


def test_hook_does_not_reapply_to_prepared_model():
    model = build_model('pspnet_r18')
    apply_gradient_filter(
        model, select_layers(model, num_layers=5, radius=2, input_size=INPUT))
    runner = _fake_runner(model)
    GradFilterHook(num_layers=10, radius=8).before_train(runner)
    assert gf_paths(model) == EXPECTED['pspnet_r18'][5]
    assert {m.radius for m in model.modules()
            if isinstance(m, GFConv2d)} == {2}


def test_hook_refuses_non_ddp_wrappers():
    from mmengine.registry import MODEL_WRAPPERS

    @MODEL_WRAPPERS.register_module(name='_ShardingWrapperForTest',
                                    force=True)
    class Sharding(torch.nn.Module):  # stands in for FSDP / DeepSpeed

        def __init__(self, module):
            super().__init__()
            self.module = module

    runner = _fake_runner(Sharding(build_model('fcn_r18')))
    with pytest.raises(TypeError, match='gradient_filter` config setting'):
        GradFilterHook(num_layers=2).before_train(runner)


def test_cost_table_input_grads():
    """The table counts g_x only where the input needs a gradient: the PSP
    branches read frozen layer4 output, the bottleneck reads the branches."""
    model = build_model('pspnet_r18')
    choices = apply_gradient_filter(
        model, select_layers(model, num_layers=5, radius=2, input_size=INPUT))
    needs = {r.path: r.input_requires_grad
             for r in trace_layers(model, INPUT, grad=True)}
    assert [needs[c.path] for c in choices] == [False] * 4 + [True]
    assert not any(p.grad is not None for p in model.parameters())
    table = chosen_layers_table(model, choices, batch=2, needs_input_grad=needs)
    lines = table.splitlines()
    assert len(lines) == 2 + 5 + 1
    assert 'FLOPs per image' in lines[0] and 'batch 2' in lines[0]
    assert lines[-1].startswith('total')
    cells = lines[-2].split()
    assert cells[0] == 'decode_head.bottleneck.conv'
    # FLOPs per image. bottleneck 1024->128, 3x3, 8x8: vanilla g_x + g_W =
    # 2 * 2*128*64*1024*9 = 301.99M; GF (r=2, 16 patches):
    # 2 * 2*128*1024*16 + g_y means 128*64 + tap sums 128*1024*9 = 9.58M
    assert cells[5:7] == ['301.99M', '9.58M']
    # saved in a step of batch 2: x is 2*1024*8*8 fp32 = 0.50MiB; patch
    # sums 1/4 of it
    assert cells[7:9] == ['0.50MiB', '0.12MiB']
    # first PSP branch (1x1 map, frozen input): only g_W, 2*128*512
    assert lines[2].split()[5:7] == ['0.13M', '0.13M']


class _Lines:
    """A runner whose logger keeps its lines (no config: batch 1)."""

    cfg = None

    def __init__(self):
        self.lines = []
        self.logger = SimpleNamespace(info=self.lines.append)


def test_budget_line_and_cost_table_state_one_figure_per_image():
    """The budget's "backward GFLOPs per image" is the table's GF total:
    both per image, both with the classifier's exact backward."""
    from mmseg_gf.accounting.format import fmt_flops_short
    from mmseg_gf.engine.config import select_and_apply
    from mmseg_gf.engine.settings import check_settings
    from mmseg_gf.engine.state import get_state
    from mmseg_gf.engine.surgery import get_gradient_filter_layers
    torch.manual_seed(0)
    model = build_model('pspnet_r18')
    settings = check_settings(dict(budget=dict(saved_mib=1000, radii=[4])))
    select_and_apply(model, settings, INPUT, batch=1)
    budget = get_state(model).budget
    runner = _Lines()
    GradFilterHook._log_cost(runner, model, get_gradient_filter_layers(model))
    table = runner.lines[0].strip().splitlines()
    classifier = next(line for line in table
                      if line.startswith('decode_head.conv_seg'))
    assert classifier.split()[3] == 'exact'
    total = table[-1].split()
    assert total[-3] == fmt_flops_short(budget.cost.backward_flops)
    assert 'per image' in budget.summary()
    kept = [line for line in runner.lines
            if 'kept for backward' in line.lower()]
    assert len(kept) == 1, runner.lines  # the step's table, once


# ----------------------------------------------------------------------------
# Runner (single process): train, checkpoint, load without GF, resume


@pytest.fixture(scope='module')
def workspace(tmp_path_factory):
    return prepare_workspace(str(tmp_path_factory.mktemp('gf_hook')))


def _hook_cfg(workspace, work_dir='hook', max_iters=3):
    cfg = runner_cfg(osp.join(workspace['root'], work_dir), workspace['voc'],
                     max_iters=max_iters)
    cfg['custom_imports'] = dict(imports=['mmseg_gf'],
                                 allow_failed_imports=False)
    cfg['custom_hooks'] = [
        dict(type='GradFilterHook', num_layers=5, radius=4)
    ]
    cfg['load_from'] = workspace['init']
    return cfg


@pytest.fixture(scope='module')
def hook_run(workspace):
    """One 3-iteration run of an unchanged config plus GradFilterHook."""
    return run_training(_hook_cfg(workspace))


def test_runner_hook_unchanged_config(workspace, hook_run):
    model = hook_run.model
    assert type(model).__name__ == 'EncoderDecoder'
    assert gf_paths(model) == EXPECTED['pspnet_r18'][5]
    assert all(m.radius == 4 for m in model.modules()
               if isinstance(m, GFConv2d))
    assert changed_modules(model.state_dict(),
                           workspace['init_state']) == PSP5
    assert not model.backbone.layer4[1].bn2.training  # frozen norm in eval


def test_checkpoint_loads_into_plain_mmseg(hook_run):
    ckpt = osp.join(hook_run.work_dir, 'iter_3.pth')
    state = torch.load(ckpt, map_location='cpu')['state_dict']
    plain = build_model('pspnet_r18')
    assert set(state) == set(plain.state_dict())
    plain.load_state_dict(state, strict=True)
    assert not gf_paths(plain)
    gf_model = hook_run.model
    gf_model.eval()
    plain.eval()
    x = torch.randn(2, 3, *INPUT)
    with torch.no_grad():
        a = gf_model(x, None, mode='tensor')
        b = plain(x, None, mode='tensor')
        pa = gf_model.predict(x)
        pb = plain.predict(x)
    assert torch.equal(a, b)
    for da, db in zip(pa, pb):
        assert torch.equal(da.pred_sem_seg.data, db.pred_sem_seg.data)


def test_resume_from_gf_checkpoint(workspace, hook_run, monkeypatch):
    # mmengine's torch.load runs with torch's default weights_only=True:
    # the checkpoint's mmengine types load through mmseg_gf's allow-list.
    ckpt = osp.join(hook_run.work_dir, 'iter_3.pth')
    saved = torch.load(ckpt, map_location='cpu')
    # resume one more iteration: the optimizer state is loaded before the
    # hook swaps layers (load_or_resume precedes before_train)
    cfg = _hook_cfg(workspace, 'resume', max_iters=4)
    cfg.update(load_from=ckpt, resume=True)
    seen = {}
    from mmengine.hooks import Hook
    from mmengine.runner import Runner

    from mmseg_gf.engine import rewrite_config

    class Probe(Hook):
        """Records the state after resume + surgery, before the 4th step."""
        priority = 'LOWEST'  # after GradFilterHook (ABOVE_NORMAL)

        def before_train(self, runner):
            opt = runner.optim_wrapper.optimizer.state_dict()['state']
            seen['opt'] = {k: v['momentum_buffer'].clone()
                           for k, v in opt.items()}
            seen['gf'] = gf_paths(runner.model)
            seen['iter'] = runner.iter

    runner = Runner.from_cfg(rewrite_config(Config(cfg)))
    runner.register_hook(Probe())
    runner.train()
    assert seen['iter'] == 3 and runner.iter == 4
    assert seen['gf'] == EXPECTED['pspnet_r18'][5]
    saved_state = saved['optimizer']['state']
    assert seen['opt'].keys() == saved_state.keys()
    assert len(saved_state) == 7  # 5 convs (weights) + conv_seg w, b
    for k in saved_state:
        assert torch.equal(seen['opt'][k], saved_state[k]['momentum_buffer'])
    assert changed_modules(runner.model.state_dict(),
                           saved['state_dict']) == PSP5


PLAIN_MMSEG_SCRIPT = r'''
import sys


class RefusePlugin:
    """Any import of mmseg_gf fails: this process is plain mmseg."""

    def find_spec(self, name, path=None, target=None):
        if name == 'mmseg_gf' or name.startswith('mmseg_gf.'):
            raise ImportError('mmseg_gf imported by a plain mmseg process')


sys.meta_path.insert(0, RefusePlugin())
import torch
from mmengine.config import ConfigDict
from mmengine.registry import init_default_scope
from mmseg.registry import MODELS
from mmseg.utils import register_all_modules

from tests.helpers.engine_fixtures import model_cfg

ckpt_path, inputs_path, out_path = sys.argv[1:4]
register_all_modules()
init_default_scope('mmseg')
model = MODELS.build(ConfigDict(model_cfg('pspnet_r18')))
# a full unpickle (any type the pickle names is imported): nothing of the
# plugin may be inside the checkpoint
checkpoint = torch.load(ckpt_path, map_location='cpu', weights_only=False)
model.load_state_dict(checkpoint['state_dict'], strict=True)
model.eval()
with torch.no_grad():
    samples = model.predict(torch.load(inputs_path))
assert not [m for m in sys.modules if m.startswith('mmseg_gf')]
torch.save(dict(
    labels=torch.stack([s.pred_sem_seg.data for s in samples]),
    logits=torch.stack([s.seg_logits.data for s in samples])), out_path)
'''


def test_checkpoint_evaluates_in_plain_mmseg_without_the_plugin(
        hook_run, tmp_path):
    """A GF-finetuned checkpoint, in a process that never imports mmseg_gf
    (imports of it are refused): loads strictly into the mmseg model and
    predicts exactly what the GF model predicts."""
    ckpt = osp.join(hook_run.work_dir, 'iter_3.pth')
    gen = torch.Generator().manual_seed(3)
    inputs = torch.randn(2, 3, *INPUT, generator=gen)
    torch.save(inputs, tmp_path / 'inputs.pth')
    script = tmp_path / 'plain_mmseg.py'
    script.write_text(PLAIN_MMSEG_SCRIPT)
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS='1')
    proc = subprocess.run(
        [sys.executable, str(script), ckpt, str(tmp_path / 'inputs.pth'),
         str(tmp_path / 'plain.pth')], env=env, capture_output=True,
        text=True, timeout=240, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    plain = torch.load(tmp_path / 'plain.pth')
    model = hook_run.model
    model.eval()
    with torch.no_grad():
        samples = model.predict(inputs)
    labels = torch.stack([s.pred_sem_seg.data for s in samples])
    logits = torch.stack([s.seg_logits.data for s in samples])
    assert logits.std() > 0  # not a degenerate constant output
    assert torch.equal(plain['labels'], labels)
    torch.testing.assert_close(plain['logits'], logits, rtol=1e-5,
                               atol=1e-6)


def test_plain_checkpoint_loads_into_gf_model_by_key(workspace, hook_run,
                                                     monkeypatch):
    """Plain mmseg checkpoint -> GF model. mmengine's ``load_from`` is
    strict=False (a bad rename would only warn), so check the keys
    strictly, and that the Runner really loaded it: every frozen tensor of
    the trained model is the checkpoint's, which differs from the seeded
    initialisation the Runner would otherwise have."""
    from mmengine.runner.checkpoint import load_checkpoint
    model = build_model('pspnet_r18')
    apply_gradient_filter(
        model, select_layers(model, num_layers=5, radius=4, input_size=INPUT))
    load_checkpoint(model, workspace['init'], map_location='cpu',
                    strict=True)  # raises on any missing / unexpected key
    init = workspace['init_state']
    assert all(torch.equal(model.state_dict()[k], v) for k, v in init.items())

    torch.manual_seed(0)
    seeded = build_model('pspnet_r18').state_dict()
    key = 'backbone.layer1.0.conv1.weight'
    assert not torch.equal(seeded[key], init[key])
    state = hook_run.model.state_dict()
    frozen = [k for k in state if k.rsplit('.', 1)[0] not in PSP5]
    assert len(frozen) > 100
    assert all(torch.equal(state[k], init[k]) for k in frozen)


def test_training_log_states_precision_and_cpu_peak_memory(hook_run):
    """The log names the training precision and, on CPU, every iteration
    line carries the measured peak resident memory (``peak_rss``, MiB)."""
    import glob
    import re
    from mmseg_gf.engine.train_log import PeakResidentMemory
    logs = glob.glob(osp.join(hook_run.work_dir, '*', '*.log'))
    text = open(sorted(logs)[-1]).read()
    assert 'training precision: AMP off' in text
    iters = [line for line in text.splitlines() if 'Iter(train)' in line]
    assert len(iters) == 3
    if PeakResidentMemory().supported:
        peaks = [float(re.search(r'peak_rss: ([\d.]+)', line).group(1))
                 for line in iters]
        assert all(p > 10 for p in peaks), peaks
