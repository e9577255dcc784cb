"""How the gradient-filter settings travel: each entry point
(``rewrite_config``, the ``GradFilterModel`` builder, ``GradFilterHook``)
checks a dict once and passes the frozen ``GradientFilterSettings`` down to
the selection; derived values are new objects, never written into the
caller's dict."""
import copy
import dataclasses
from argparse import Namespace
from types import SimpleNamespace

import pytest
import torch
from mmengine.config import Config, ConfigDict
from mmengine.logging import MMLogger

from mmseg_gf.analysis.cost_cli import load_config
from mmseg_gf.engine import GradFilterHook, rewrite_config
from mmseg_gf.engine import config as config_module
from mmseg_gf.engine.config import build_grad_filter_model, config_settings
from mmseg_gf.engine.hooks import grad_filter_hook
from mmseg_gf.engine.settings import GradientFilterSettings
from tests.helpers.engine_fixtures import (EXPECTED, build_model, gf_paths,
                                           model_cfg)

INPUT = (64, 64)


@pytest.fixture
def from_dict_calls(monkeypatch):
    """The dicts ``GradientFilterSettings.from_dict`` checks, in order."""
    calls = []
    original = GradientFilterSettings.from_dict

    def spy(cls, settings):
        calls.append(copy.deepcopy(settings))
        return original(settings)

    monkeypatch.setattr(GradientFilterSettings, 'from_dict',
                        classmethod(spy))
    return calls


@pytest.fixture
def selected(monkeypatch):
    """The settings objects ``select_and_apply`` receives (it still runs),
    from the builder and from the hook."""
    seen = []
    original = config_module.select_and_apply

    def spy(segmentor, settings, *args, **kwargs):
        seen.append(settings)
        return original(segmentor, settings, *args, **kwargs)

    monkeypatch.setattr(config_module, 'select_and_apply', spy)
    monkeypatch.setattr(grad_filter_hook, 'select_and_apply', spy)
    return seen


def test_settings_are_frozen_and_a_replace_is_checked_again():
    s = GradientFilterSettings(num_layers=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.num_layers = 3
    assert dataclasses.replace(s, input_size=32).input_size == (32, 32)
    assert s.input_size is None
    with pytest.raises(ValueError, match='input_size must be'):
        dataclasses.replace(s, input_size=(0, 1))
    radius = {'*': 2}
    assert GradientFilterSettings(num_layers=2, radius=radius).radius \
        is not radius


def test_rewrite_checks_once_and_leaves_the_users_settings(from_dict_calls):
    given = dict(budget=dict(saved_mib=300, radii=[8, 2]),
                 radius=None, layer_kinds=['conv2d'])
    cfg = Config(dict(
        model=model_cfg('fcn_r18'), train_dataloader=dict(batch_size=3),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.01)),
        gradient_filter=given))
    before = copy.deepcopy(cfg.gradient_filter.to_dict())
    rewrite_config(cfg)
    assert from_dict_calls == [before]
    assert cfg.gradient_filter.to_dict() == before
    assert given == dict(budget=dict(saved_mib=300, radii=[8, 2]),
                         radius=None, layer_kinds=['conv2d'])
    model = cfg.model
    assert model.type == 'GradFilterModel'
    assert tuple(model.input_size) == tuple(
        model_cfg('fcn_r18')['data_preprocessor']['size'])
    assert model.budget.batch == 3
    assert model.budget.optimizer == dict(type='SGD', lr=0.01)
    assert tuple(model.budget.radii) == (2, 8)


def test_rewrite_takes_the_dataclass_and_keeps_a_plain_config():
    settings = GradientFilterSettings(num_layers=2, radius=8)
    cfg = Config(dict(model=model_cfg('fcn_r18'), crop_size=INPUT,
                      gradient_filter=settings))
    rewrite_config(cfg)
    assert isinstance(cfg.gradient_filter, ConfigDict)
    assert cfg.gradient_filter.to_dict() == settings.as_dict()
    assert cfg.model.num_layers == 2 and cfg.model.radius == 8
    assert tuple(cfg.model.input_size) == INPUT
    assert settings.input_size is None
    # a rewritten config with the setting is accepted again as it is
    assert rewrite_config(cfg).model.type == 'GradFilterModel'


def test_builder_checks_its_keywords_once_and_selects_with_the_object(
        from_dict_calls, selected):
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS
    init_default_scope('mmseg')
    torch.manual_seed(0)
    model = MODELS.build(ConfigDict(
        type='GradFilterModel', model=model_cfg('fcn_r18'),
        num_layers=2, input_size=INPUT))
    assert len(from_dict_calls) == 1
    assert len(selected) == 1
    assert isinstance(selected[0], GradientFilterSettings)
    assert selected[0].num_layers == 2
    assert gf_paths(model) == EXPECTED['fcn_r18'][5][-2:]

    settings = GradientFilterSettings(num_layers=1, input_size=INPUT)
    model = build_grad_filter_model(model_cfg('fcn_r18'), settings=settings)
    assert len(from_dict_calls) == 1  # the object is not checked again
    assert selected[1] is settings
    assert gf_paths(model) == EXPECTED['fcn_r18'][5][-1:]
    with pytest.raises(ValueError, match=r'not both; got settings and '
                       r"\['num_layers'\]"):
        build_grad_filter_model(model_cfg('fcn_r18'), settings=settings,
                                num_layers=2)


def _fake_runner(model):
    return SimpleNamespace(model=model, cfg=Config(dict(crop_size=INPUT)),
                           logger=MMLogger.get_current_instance())


def test_hook_passes_its_object_and_leaves_the_users_dict(
        from_dict_calls, selected):
    given = dict(num_layers=2, radius={'*': 4})
    before = copy.deepcopy(given)
    hook = GradFilterHook(**given, log_table=False)
    assert len(from_dict_calls) == 1
    hook.before_train(_fake_runner(build_model('fcn_r18')))
    assert len(from_dict_calls) == 1
    assert selected == [hook.settings]
    assert selected[0] is hook.settings
    assert isinstance(hook.settings, GradientFilterSettings)
    assert hook.settings.input_size is None  # the crop is passed, not set
    assert given == before
    assert hook.settings.radius is not given['radius']


def test_hook_takes_the_dataclass_as_one_argument(from_dict_calls):
    settings = GradientFilterSettings(num_layers=2)
    hook = GradFilterHook(settings, log_table=False)
    assert hook.settings is settings and hook.configured
    assert from_dict_calls == []
    assert GradFilterHook(dict(num_layers=3)).settings.num_layers == 3
    with pytest.raises(ValueError, match=r'not both; got an object and '
                       r"\['radius'\]"):
        GradFilterHook(settings, radius=4)
    with pytest.raises(ValueError, match='exactly one of num_layers'):
        GradFilterHook(dict(radius=4))


def test_the_cost_tool_checks_the_setting_once_when_loading(tmp_path):
    """``tools/analyze_cost.py``: a hook's settings are checked when the
    config is loaded (a bad one before any model is built) and travel in
    the config as the checked object."""
    def loaded(**hook):
        path = tmp_path / 'cfg.py'
        path.write_text(f'custom_hooks = [dict(type="GradFilterHook", '
                        f'**{hook!r})]\n')
        return load_config(Namespace(config=str(path), cfg_options=None,
                                     offline=False, setting=None))

    cfg = loaded(num_layers=2, lean=False)
    settings = cfg.gradient_filter
    assert isinstance(settings, GradientFilterSettings)
    assert (settings.num_layers, settings.lean, settings.radius) == (2,
                                                                    False, 4)
    assert config_settings(cfg) is settings
    with pytest.raises(ValueError, match='mode must be one of'):
        loaded(num_layers=2, mode='exact')
    assert config_settings(Config(dict())) is None
    assert config_settings(Config(dict(gradient_filter=dict(
        num_layers=3)))) == GradientFilterSettings(num_layers=3)
