"""The ``compile`` setting a gradient-filtered model trains with: with the
lean region on CPU, Inductor's layout optimization off, on CUDA
``mode='reduce-overhead'``, unless the setting says otherwise
(mmseg_gf/engine/compile_settings.py says why); taken over by
``GradFilterHook`` before the Runner compiles, for the segmentor's loss
(mmseg_gf/engine/compiled_loss.py)."""
from types import SimpleNamespace

import pytest
from mmengine.config import Config
from mmengine.logging import MMLogger
from torch import nn

from mmseg_gf.engine import GradFilterHook
from mmseg_gf.engine.compile_settings import compile_setting
from mmseg_gf.engine.state import GradientFilterState, set_state

OFF = {'options': {'layout_optimization': False}}


@pytest.mark.parametrize('setting, want', [
    (True, OFF),
    ({}, OFF),  # mmengine compiles with torch's defaults
    (dict(dynamic=False), dict(dynamic=False, **OFF)),
    (dict(backend='inductor', fullgraph=True),
     dict(backend='inductor', fullgraph=True, **OFF)),
    (dict(mode=None), dict(mode=None, **OFF)),
    # torch.compile takes a mode or options: torch's default mode is dropped
    (dict(mode='default', dynamic=False), dict(dynamic=False, **OFF)),
])
def test_cpu_inductor_settings_get_the_layout_option(setting, want):
    before = setting if isinstance(setting, bool) else dict(setting)
    assert compile_setting(setting, 'cpu', True) == want
    assert setting == before  # the caller's dict is not edited


@pytest.mark.parametrize('setting', [
    None, False, dict(mode='max-autotune'),
    dict(options={'layout_optimization': True}), dict(backend='aot_eager')])
def test_settings_that_say_otherwise_are_kept(setting):
    assert compile_setting(setting, 'cpu', True) is setting


@pytest.mark.parametrize('device, lean', [('meta', True), ('cuda', False),
                                          ('cpu', False)])
def test_other_devices_and_models_without_the_lean_region_keep_it(
        device, lean):
    setting = dict(fullgraph=True)
    assert compile_setting(True, device, lean) is True
    assert compile_setting(setting, device, lean) is setting


@pytest.mark.parametrize('setting, want', [
    (True, dict(mode='reduce-overhead')),
    ({}, dict(mode='reduce-overhead')),
    (dict(fullgraph=True), dict(fullgraph=True, mode='reduce-overhead'))])
def test_cuda_lean_settings_get_cuda_graphs(setting, want):
    assert compile_setting(setting, 'cuda', True) == want


@pytest.mark.parametrize('setting', [
    dict(mode='default'), dict(mode='max-autotune-no-cudagraphs'),
    dict(options={'triton.cudagraphs': False}), dict(backend='aot_eager')])
def test_cuda_settings_that_say_otherwise_are_kept(setting):
    assert compile_setting(setting, 'cuda', True) is setting


def test_a_bad_setting_is_refused_with_the_types_taken():
    with pytest.raises(TypeError, match='None, a bool or a dict'):
        compile_setting('yes', 'cpu', True)


def _runner(model: nn.Module, **cfg):
    return SimpleNamespace(model=model, cfg=Config(cfg),
                           logger=MMLogger.get_current_instance())


def _before_run(runner, **hook_args) -> GradFilterHook:
    hook = GradFilterHook(check_load_from=False,
                          **dict(dict(num_layers=1), **hook_args))
    hook.before_run(runner)
    return hook


@pytest.mark.parametrize('setting, want', [
    (True, dict(OFF, dynamic=False)),
    (dict(mode='max-autotune'), dict(mode='max-autotune', dynamic=False)),
    # accepted on CPU (no CUDA graphs there) and passed on as it is
    (dict(mode='reduce-overhead'),
     dict(mode='reduce-overhead', dynamic=False)),
    (dict(dynamic=True, target='loss'), dict(OFF, dynamic=True))])
def test_hook_takes_the_setting_over_for_the_loss(setting, want):
    """``before_run`` precedes the Runner's ``_maybe_compile``: the hook
    keeps the setting, for the model's device, to compile the segmentor's
    loss with, and leaves the Runner nothing to compile."""
    runner = _runner(nn.Conv2d(1, 1, 1), compile=setting)
    assert _before_run(runner)._compile == want
    assert runner.cfg.compile is False


@pytest.mark.parametrize('setting, want', [
    (dict(target='train_step'), OFF),
    (dict(target='train_step', mode='reduce-overhead'),
     dict(mode='reduce-overhead'))])
def test_hook_leaves_train_step_to_the_runner_when_asked(setting, want):
    runner = _runner(nn.Conv2d(1, 1, 1), compile=setting)
    assert _before_run(runner)._compile is None
    got = runner.cfg.compile
    assert (got.to_dict() if hasattr(got, 'to_dict') else got) == want


def test_a_bad_target_is_refused_with_the_targets_taken():
    runner = _runner(nn.Conv2d(1, 1, 1), compile=dict(target='forward'))
    with pytest.raises(ValueError, match=r"\['loss', 'train_step'\]"):
        _before_run(runner)


def test_hook_leaves_no_setting_alone_and_off_devices_unchanged():
    runner = _runner(nn.Conv2d(1, 1, 1))
    assert _before_run(runner)._compile is None
    assert runner.cfg.get('compile') is None
    runner = _runner(nn.Conv2d(1, 1, 1), compile=False)
    assert _before_run(runner)._compile is None
    runner = _runner(nn.Conv2d(1, 1, 1, device='meta'), compile=True)
    assert _before_run(runner)._compile == dict(dynamic=False)
    runner = _runner(nn.Conv2d(1, 1, 1), compile=True)
    assert _before_run(runner, lean=False)._compile == dict(dynamic=False)


@pytest.mark.parametrize('lean, want', [(True, dict(OFF, dynamic=False)),
                                        (False, dict(dynamic=False))])
def test_hook_reads_a_prepared_models_lean_setting(lean, want):
    """A model built by ``GradFilterModel`` (the config rewrite) carries its
    settings: its ``lean`` decides, not the hook's (which has none)."""
    model = nn.Conv2d(1, 1, 1)
    set_state(model, GradientFilterState(layers=[], lean=lean))
    runner = _runner(model, compile=True)
    hook = GradFilterHook(check_load_from=False)
    hook.before_run(runner)
    assert hook._compile == want
