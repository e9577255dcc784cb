"""The concrete configs: every file under configs/gf and configs/calib is
named by mmseg's scheme (tests/helpers/config_names.py), loads with
mmengine, holds
what its name says, and the common cases are all there; a representative
subset of configs/gf builds with its gradient_filter setting applied."""
import copy
import glob
import os.path as osp

import pytest
import torch
from mmengine.config import Config

from mmseg_gf.protocol.experiments import PROTOCOL_MODELS, strategy_file
from tests.helpers.config_names import config_name, parse_config_name
from tests.helpers.engine_fixtures import EXPECTED, gf_paths
from tests.helpers.tools import REPO  # noqa: E402

GF_DIR = osp.join(REPO, 'configs', 'gf')
CALIB_DIR = osp.join(REPO, 'configs', 'calib')
PATHS = sorted(
    glob.glob(osp.join(GF_DIR, '*.py')) +
    glob.glob(osp.join(CALIB_DIR, '*.py')))

#: The documented entry point keeps its short name; it is the same config as
#: its scheme-named twin.
SHORT_NAMES = {
    'pspnet_r18_voc_r4.py':
    'pspnet_r18-d8_gf-last5-r4_1xb8-20k_voc12aug-512x512.py'
}
#: The finetuning strategies every model and target has a config for.
COMMON = {
    'gf_last5_r4': dict(num_layers=5, radius=4, mode='gf',
                        layer_kinds=['conv2d']),
    'vanilla_last5': dict(num_layers=5, mode='vanilla',
                          layer_kinds=['conv2d']),
}
#: target -> (classes, training crop (H, W)).
TARGETS = {'voc': (21, (512, 512)), 'cityscapes': (19, (512, 1024))}
#: model key prefix -> decode head type; backbone by suffix.
HEADS = {'pspnet': 'PSPHead', 'deeplabv3': 'ASPPHead', 'fcn': 'FCNHead',
         'upernet': 'UPerHead'}
BACKBONES = {'r18': 'ResNetV1c', 'mv2': 'MobileNetV2'}

_loaded = {}


def _load(path: str) -> Config:
    """Config.fromfile, once per file (resolving ``mmseg::`` bases is
    slow); callers that change the config copy it first."""
    if path not in _loaded:
        _loaded[path] = Config.fromfile(path)
    return _loaded[path]


def _calib_schedule(model: str) -> str:
    """1000 iterations, 5000 for the models whose decoder is calibrated."""
    if PROTOCOL_MODELS[model].calibration == 'calibrate_decoder':
        return '1xb8-5k'
    return '1xb8-1k'


def test_the_common_cases_are_all_there():
    """GF last 5 (r=4) and vanilla last 5 for the six models and both
    targets, and the calibration each of them starts from."""
    gf = {osp.basename(p) for p in glob.glob(osp.join(GF_DIR, '*.py'))}
    calib = {osp.basename(p) for p in glob.glob(osp.join(CALIB_DIR, '*.py'))}
    for model in PROTOCOL_MODELS:
        for target in TARGETS:
            for strategy in COMMON:
                assert config_name(model, target, strategy, '1xb8-20k') in gf
            assert config_name(model, target, 'calib',
                               _calib_schedule(model)) in calib
    assert set(SHORT_NAMES) <= gf


@pytest.mark.parametrize('path', PATHS, ids=osp.basename)
def test_config_loads_and_its_name_says_what_it_holds(path):
    cfg = _load(path)
    name = osp.basename(path)
    if name in SHORT_NAMES:
        twin = _load(osp.join(GF_DIR, SHORT_NAMES[name]))
        assert cfg.to_dict() == twin.to_dict()
        return
    model, target, strategy, schedule = parse_config_name(path)
    assert name == config_name(model, target, strategy, schedule)
    assert (osp.dirname(path) == CALIB_DIR) == (strategy == 'calib')

    algorithm, backbone = model.split('_')
    assert cfg.model.decode_head.type == HEADS[algorithm]
    assert cfg.model.backbone.type == BACKBONES[backbone]
    classes, crop = TARGETS[target]
    assert cfg.model.decode_head.num_classes == classes
    assert tuple(cfg.model.data_preprocessor.size) == crop
    assert tuple(cfg.crop_size) == crop
    devices_batch, iters = schedule.split('-')
    assert devices_batch == f'1xb{cfg.train_dataloader.batch_size}'
    assert iters == f'{cfg.train_cfg.max_iters // 1000}k'
    assert cfg.train_cfg.max_iters % 1000 == 0

    if strategy == 'calib':
        assert 'gradient_filter' not in cfg
        assert schedule == _calib_schedule(model)
        assert [h.type for h in cfg.custom_hooks] == ['CalibrationHook']
        return
    want = Config.fromfile(strategy_file(strategy, model)).gradient_filter
    assert cfg.gradient_filter == want
    if strategy in COMMON:
        assert cfg.gradient_filter == COMMON[strategy]


# One config per model, both targets and both strategies among them.
BUILT = [
    config_name(*case, '1xb8-20k') for case in [
        ('pspnet_r18', 'voc', 'gf_last5_r4'),
        ('pspnet_mv2', 'cityscapes', 'vanilla_last5'),
        ('deeplabv3_r18', 'cityscapes', 'gf_last5_r4'),
        ('deeplabv3_mv2', 'voc', 'gf_last5_r4'),
        ('fcn_r18', 'voc', 'vanilla_last5'),
        ('upernet_r18', 'cityscapes', 'gf_last5_r4'),
    ]
]


@pytest.mark.parametrize('name', BUILT)
def test_config_builds_with_its_gradient_filter(name):
    """The config's model, rewritten as tools/train.py does, at a 64x64
    trace: the last 5 convs wrapped (filter on for GF, off for vanilla),
    everything but them and the classifier frozen, and gradients of one
    backward on exactly those."""
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS as SEG_MODELS

    from mmseg_gf.engine import rewrite_config
    model_key, target, strategy, _ = parse_config_name(name)
    cfg = copy.deepcopy(_load(osp.join(GF_DIR, name)))
    cfg.gradient_filter['input_size'] = (64, 64)
    rewrite_config(cfg)
    assert cfg.model.type == 'GradFilterModel'
    init_default_scope('mmseg')
    torch.manual_seed(0)
    model = SEG_MODELS.build(cfg.model)

    paths = gf_paths(model)
    assert paths == EXPECTED[model_key][5]
    gf = strategy.startswith('gf_')
    for path in paths:
        conv = model.get_submodule(path)
        assert conv.enabled == gf
        if gf:
            assert conv.radius == 4
    trainable = {
        n.rsplit('.', 1)[0]
        for n, p in model.named_parameters() if p.requires_grad
    }
    assert trainable == set(paths) | {'decode_head.conv_seg'}

    model.eval()
    logits = model._forward(torch.randn(2, 3, 64, 64))
    assert logits.shape[:2] == (2, TARGETS[target][0])
    logits.square().mean().backward()
    with_grad = {
        n.rsplit('.', 1)[0]
        for n, p in model.named_parameters() if p.grad is not None
    }
    assert with_grad == trainable
