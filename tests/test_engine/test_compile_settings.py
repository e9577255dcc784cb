"""The ``compile`` setting a gradient-filtered model trains with: with the
lean region on CPU, Inductor's layout optimization off unless the setting
says otherwise (mmseg_gf/engine/compile_settings.py says why); set by
``GradFilterHook`` before the Runner compiles."""
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


@pytest.mark.parametrize('device, lean', [('cuda', True), ('meta', True),
                                          ('cpu', False)])
def test_other_devices_and_models_without_the_lean_region_keep_it(
        device, lean):
    setting = dict(fullgraph=True)
    assert compile_setting(True, device, lean) is True
    assert compile_setting(setting, device, lean) is setting


def test_a_bad_setting_is_refused_with_the_types_taken():
    with pytest.raises(TypeError, match='None, a bool or a dict'):
        compile_setting('yes', 'cpu', True)


def _runner(model: nn.Module, **cfg):
    return SimpleNamespace(model=model, cfg=Config(cfg),
                           logger=MMLogger.get_current_instance())


@pytest.mark.parametrize('setting, want', [
    (True, OFF), (dict(mode='max-autotune'), dict(mode='max-autotune'))])
def test_hook_sets_the_runners_setting_before_it_compiles(setting, want):
    """``before_run`` precedes the Runner's ``_maybe_compile``: the hook
    writes the setting there, for the model's device."""
    runner = _runner(nn.Conv2d(1, 1, 1), compile=setting)
    GradFilterHook(num_layers=1, check_load_from=False).before_run(runner)
    got = runner.cfg.compile
    assert (got.to_dict() if hasattr(got, 'to_dict') else got) == want


def test_hook_leaves_no_setting_other_devices_and_lean_off_alone():
    runner = _runner(nn.Conv2d(1, 1, 1))
    GradFilterHook(num_layers=1, check_load_from=False).before_run(runner)
    assert runner.cfg.get('compile') is None
    runner = _runner(nn.Conv2d(1, 1, 1, device='meta'), compile=True)
    GradFilterHook(num_layers=1, check_load_from=False).before_run(runner)
    assert runner.cfg.compile is True
    runner = _runner(nn.Conv2d(1, 1, 1), compile=True)
    GradFilterHook(num_layers=1, lean=False,
                   check_load_from=False).before_run(runner)
    assert runner.cfg.compile is True


@pytest.mark.parametrize('lean, want', [(True, OFF), (False, True)])
def test_hook_reads_a_prepared_models_lean_setting(lean, want):
    """A model built by ``GradFilterModel`` (the config rewrite) carries its
    settings: its ``lean`` decides, not the hook's (which has none)."""
    model = nn.Conv2d(1, 1, 1)
    set_state(model, GradientFilterState(layers=[], lean=lean))
    runner = _runner(model, compile=True)
    GradFilterHook(check_load_from=False).before_run(runner)
    got = runner.cfg.compile
    assert (got.to_dict() if hasattr(got, 'to_dict') else got) == want
