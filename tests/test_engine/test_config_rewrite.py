"""The ``gradient_filter`` config setting: validation, the ``GradFilterModel``
builder, ``rewrite_config`` and a real (single-process) Runner run."""
import copy
import os.path as osp

import pytest
import torch
from mmengine.config import Config, ConfigDict

from mmseg_gf.engine import check_settings, rewrite_config
from mmseg_gf.models import GFConv2d
from tests.helpers.engine_fixtures import (
    EXPECTED, build_model, changed_modules, gf_paths, model_cfg,
    prepare_workspace, run_training, runner_cfg)

PSP5 = set(EXPECTED['pspnet_r18'][5]) | {'decode_head.conv_seg'}


@pytest.mark.parametrize('settings, match', [
    (5, r'gradient_filter must be a dict, e\.g\. dict\(num_layers=5'),
    ([('num_layers', 5)], 'gradient_filter must be a dict'),
    (dict(num_layers=5, radius='4'), "radius must be an int >= 1, 'auto'"),
    (dict(num_layers=5, radus=4), r"unknown key\(s\) \['radus'\]"),
    (dict(num_layers=5, mode='fast'),
     r"mode must be one of \('gf', 'vanilla'\)"),
    (dict(radius=4), 'exactly one of num_layers'),
    (dict(num_layers=5, layers=['x']), 'exactly one of num_layers'),
    (dict(num_layers=0), 'num_layers must be an int >= 1'),
    (dict(num_layers=True), 'num_layers must be an int >= 1'),
    (dict(layers=[3]), 'layers must be a non-empty list of module paths'),
    (dict(num_layers=5, radius=-1), 'radius must be an int >= 1'),
    (dict(num_layers=5, radius=2.0), 'radius must be an int >= 1'),
    (dict(num_layers=5, radius={'decode_head': 0}), 'radius must be'),
    (dict(num_layers=5, input_size=(64, )), 'input_size must be'),
    (dict(num_layers=5, train_norm='yes'), 'train_norm must be'),
    (dict(num_layers=5, lean=1), 'lean must be True or False'),
    (dict(num_layers=5, patch_mean_activations='no'),
     'patch_mean_activations must be True or False'),
    (dict(num_layers=5, leen=True), r"unknown key\(s\) \['leen'\]"),
])
def test_bad_settings(settings, match):
    with pytest.raises(ValueError, match=match):
        check_settings(settings)


def test_defaults_filled():
    s = check_settings(dict(layers='decode_head', input_size=64))
    assert s == dict(num_layers=None, layers=['decode_head'], radius=4,
                     mode='gf', train_norm=False, lean=True,
                     input_size=(64, 64), budget=None,
                     keep_frozen_aux_heads=False, log_frozen_aux_losses=False,
                     reuse_cpu_memory=False, layer_kinds=None,
                     patch_mean_activations=True)
    # radius=None is the default too (GradFilterHook passes it)
    assert check_settings(dict(num_layers=2, radius=None))['radius'] == 4


def test_rewrite_fails_early_before_building_anything():
    cfg = Config(dict(model=model_cfg('fcn_r18'),
                      gradient_filter=dict(num_layers=5, mode='exact')))
    with pytest.raises(ValueError, match='mode must be one of'):
        rewrite_config(cfg)
    assert cfg.model.type == 'EncoderDecoder'  # untouched


def test_rewrite_without_setting_is_a_no_op():
    cfg = Config(dict(model=model_cfg('fcn_r18')))
    before = copy.deepcopy(cfg.to_dict())
    assert rewrite_config(cfg).to_dict() == before


def test_builder_returns_plain_segmentor():
    """``GradFilterModel`` builds the mmseg class itself: plain keys."""
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS
    init_default_scope('mmseg')
    torch.manual_seed(0)
    model = MODELS.build(ConfigDict(
        type='GradFilterModel', model=model_cfg('deeplabv3_r18'),
        num_layers=5, radius={'*': 3, 'decode_head.aspp_modules.3': 9},
        mode='vanilla', input_size=(64, 64)))
    assert type(model).__name__ == 'EncoderDecoder'
    assert gf_paths(model) == EXPECTED['deeplabv3_r18'][5]
    radii = [model.get_submodule(p).radius for p in gf_paths(model)]
    assert radii == [3, 3, 3, 9, 3]
    assert not any(m.enabled for m in model.modules()
                   if isinstance(m, GFConv2d))
    assert set(model.state_dict()) == set(
        build_model('deeplabv3_r18').state_dict())
    # an unknown path fails at build time, naming close matches
    with pytest.raises(ValueError, match='did you mean'):
        MODELS.build(ConfigDict(type='GradFilterModel',
                                model=model_cfg('fcn_r18'),
                                layers=['decode_head.conv_cat.con'],
                                input_size=(64, 64)))


@pytest.fixture(scope='module')
def workspace(tmp_path_factory):
    return prepare_workspace(str(tmp_path_factory.mktemp('gf_rewrite')))


def test_runner_config_rewrite(workspace):
    from mmseg.registry import MODELS
    cfg = runner_cfg(osp.join(workspace['root'], 'rewrite'), workspace['voc'])
    cfg['gradient_filter'] = dict(num_layers=5, radius=4)
    cfg['load_from'] = workspace['init']
    rewritten = rewrite_config(Config(copy.deepcopy(cfg)))
    assert rewritten.model.type == 'GradFilterModel'
    assert rewritten.model.input_size == (64, 64)  # from crop / preprocessor
    assert rewritten.custom_hooks == [dict(type='GradFilterHook')]
    assert 'mmseg_gf' in rewritten.custom_imports['imports']
    # idempotent
    assert rewrite_config(rewritten).model.model.type == 'EncoderDecoder'
    # ... unless one of the two settings was edited afterwards
    edited = Config(copy.deepcopy(rewritten._cfg_dict.to_dict()))
    edited.merge_from_dict({'gradient_filter.num_layers': 7})
    with pytest.raises(ValueError, match=r'disagrees.*num_layers: '
                       r'gradient_filter 7, model 5'):
        rewrite_config(edited)
    edited = Config(copy.deepcopy(rewritten._cfg_dict.to_dict()))
    edited.merge_from_dict({'model.radius': 8})
    with pytest.raises(ValueError, match='radius: gradient_filter 4, model 8'):
        rewrite_config(edited)
    # the dumped config builds on its own (custom_imports added)
    path = osp.join(workspace['root'], 'rewritten.py')
    rewritten.dump(path)
    reloaded = Config.fromfile(path)
    assert gf_paths(MODELS.build(reloaded.model)) == \
        EXPECTED['pspnet_r18'][5]

    runner = run_training(cfg)  # 3 iterations, checkpoint at the end
    model = runner.model
    assert type(model).__name__ == 'EncoderDecoder'
    assert gf_paths(model) == EXPECTED['pspnet_r18'][5]
    assert all(m.radius == 4 for m in model.modules()
               if isinstance(m, GFConv2d))
    assert changed_modules(model.state_dict(), workspace['init_state']) == \
        PSP5
    assert not model.backbone.layer4[1].bn2.training  # frozen norm in eval
    # the checkpoint has plain mmseg keys
    state = torch.load(osp.join(runner.work_dir, 'iter_3.pth'),
                       map_location='cpu')['state_dict']
    assert set(state) == set(workspace['init_state'])


def test_prepare_cpu_distributed(monkeypatch):
    """tools/train.py --launcher pytorch on a machine without CUDA: gloo and
    a DDP wrapper without device ids; GPU machines and launcher 'none' keep
    the config as it is."""
    from mmengine.registry import MODEL_WRAPPERS

    from mmseg_gf.engine.cpu_distributed import (CPUDistributedDataParallel,
                                                 prepare_cpu_distributed)
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)

    def prepared(**cfg):
        return prepare_cpu_distributed(Config(dict(model=dict(), **cfg)))

    assert 'env_cfg' not in prepared(launcher='none')
    cfg = prepared(launcher='pytorch', find_unused_parameters=True,
                   env_cfg=dict(dist_cfg=dict(backend='nccl', timeout=60)))
    assert cfg.env_cfg.dist_cfg == dict(backend='gloo', timeout=60)
    assert cfg.model_wrapper_cfg == dict(type='CPUDistributedDataParallel',
                                         broadcast_buffers=False,
                                         find_unused_parameters=True)
    assert MODEL_WRAPPERS.get('CPUDistributedDataParallel') is \
        CPUDistributedDataParallel
    cfg = prepared(launcher='pytorch',
                   model_wrapper_cfg=dict(type='MMDistributedDataParallel',
                                          broadcast_buffers=True))
    assert cfg.model_wrapper_cfg == dict(type='CPUDistributedDataParallel',
                                         broadcast_buffers=True)
    assert cfg.env_cfg.dist_cfg.backend == 'gloo'
    cfg = prepared(launcher='slurm', env_cfg=dict(dist_cfg=dict(
        backend='mpi')), model_wrapper_cfg=dict(type='MyWrapper'))
    assert cfg.env_cfg.dist_cfg.backend == 'mpi'
    assert cfg.model_wrapper_cfg.type == 'MyWrapper'
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    cfg = prepared(launcher='pytorch',
                   env_cfg=dict(dist_cfg=dict(backend='nccl')))
    assert cfg.env_cfg.dist_cfg.backend == 'nccl'
    assert 'model_wrapper_cfg' not in cfg
