"""Tiny mmseg model configs and a tiny VOC dataset for the engine tests,
and the gradient-filtered copy of a model and its step's saved bytes, which
the engine and accounting tests build alike.

Models follow mmseg's ``*_r18-d8`` / ``upernet_r18`` / ``mobilenet-v2-d8``
configs (same module structure, hence same module paths), with plain BN,
no auxiliary head, few classes and no pretrained weights.
"""
import copy
import os
import os.path as osp
from typing import Dict

import numpy as np

NUM_CLASSES = 3
NORM = dict(type='BN', requires_grad=True)
DATA_PREPROCESSOR = dict(
    type='SegDataPreProcessor',
    mean=[123.675, 116.28, 103.53],
    std=[58.395, 57.12, 57.375],
    bgr_to_rgb=True,
    pad_val=0,
    seg_pad_val=255,
    size=(64, 64))


def _resnet18(dilated: bool) -> dict:
    return dict(
        type='ResNetV1c',
        depth=18,
        num_stages=4,
        out_indices=(0, 1, 2, 3),
        dilations=(1, 1, 2, 4) if dilated else (1, 1, 1, 1),
        strides=(1, 2, 1, 1) if dilated else (1, 2, 2, 2),
        norm_cfg=NORM,
        norm_eval=False,
        style='pytorch',
        contract_dilation=True)


MOBILENET_V2 = dict(
    type='MobileNetV2',
    widen_factor=1.,
    strides=(1, 2, 2, 1, 1, 1, 1),
    dilations=(1, 1, 1, 2, 2, 4, 4),
    out_indices=(1, 2, 4, 6),
    norm_cfg=NORM)


def _loss() -> dict:
    return dict(type='CrossEntropyLoss', use_sigmoid=False, loss_weight=1.0)


def _psp_head(in_channels: int) -> dict:
    return dict(type='PSPHead', in_channels=in_channels, in_index=3,
                channels=128, pool_scales=(1, 2, 3, 6), dropout_ratio=0.1,
                num_classes=NUM_CLASSES, norm_cfg=NORM, align_corners=False,
                loss_decode=_loss())


def _aspp_head(in_channels: int) -> dict:
    return dict(type='ASPPHead', in_channels=in_channels, in_index=3,
                channels=128, dilations=(1, 12, 24, 36), dropout_ratio=0.1,
                num_classes=NUM_CLASSES, norm_cfg=NORM, align_corners=False,
                loss_decode=_loss())


HEADS: Dict[str, dict] = {
    'pspnet_r18': dict(backbone=_resnet18(True), decode_head=_psp_head(512)),
    'deeplabv3_r18': dict(backbone=_resnet18(True),
                          decode_head=_aspp_head(512)),
    'fcn_r18': dict(
        backbone=_resnet18(True),
        decode_head=dict(type='FCNHead', in_channels=512, in_index=3,
                         channels=128, num_convs=2, concat_input=True,
                         dropout_ratio=0.1, num_classes=NUM_CLASSES,
                         norm_cfg=NORM, align_corners=False,
                         loss_decode=_loss())),
    'upernet_r18': dict(
        backbone=_resnet18(False),
        decode_head=dict(type='UPerHead', in_channels=[64, 128, 256, 512],
                         in_index=[0, 1, 2, 3], pool_scales=(1, 2, 3, 6),
                         channels=128, dropout_ratio=0.1,
                         num_classes=NUM_CLASSES, norm_cfg=NORM,
                         align_corners=False, loss_decode=_loss())),
    'pspnet_mv2': dict(backbone=MOBILENET_V2, decode_head=_psp_head(320)),
    'deeplabv3_mv2': dict(backbone=MOBILENET_V2,
                          decode_head=_aspp_head(320)),
}


# Expected "last N" selections, derived by reading the heads' forward code:
# PSPHead runs psp_modules (pool scales 1, 2, 3, 6) then bottleneck;
# ASPPHead runs image_pool, aspp_modules (4 dilations), bottleneck; FCNHead
# runs convs then conv_cat; UPerHead runs lateral_convs, then the PPM
# (psp_modules, bottleneck) on the last level, then fpn_convs and
# fpn_bottleneck (it registers the PPM first). ResNet BasicBlock runs conv1,
# conv2, then downsample; MobileNetV2 InvertedResidual runs conv.0 (expand),
# conv.1 (depthwise), conv.2 (project).
R18_LAYER4 = [
    'backbone.layer4.0.conv1', 'backbone.layer4.0.conv2',
    'backbone.layer4.0.downsample.0', 'backbone.layer4.1.conv1',
    'backbone.layer4.1.conv2'
]
PSP = [f'decode_head.psp_modules.{i}.1.conv' for i in range(4)] + \
    ['decode_head.bottleneck.conv']
ASPP = [f'decode_head.aspp_modules.{i}.conv' for i in range(4)] + \
    ['decode_head.bottleneck.conv']
MV2_TAIL = ['backbone.layer7.0.conv.0.conv', 'backbone.layer7.0.conv.1.conv',
            'backbone.layer7.0.conv.2.conv']

EXPECTED = {
    'pspnet_r18': {
        1: ['decode_head.bottleneck.conv'],
        5: PSP,
        10: R18_LAYER4 + PSP,
    },
    'deeplabv3_r18': {
        1: ['decode_head.bottleneck.conv'],
        5: ASPP,
        10: R18_LAYER4[1:] + ['decode_head.image_pool.1.conv'] + ASPP,
    },
    'fcn_r18': {
        1: ['decode_head.conv_cat.conv'],
        5: R18_LAYER4[3:] + [
            'decode_head.convs.0.conv', 'decode_head.convs.1.conv',
            'decode_head.conv_cat.conv'
        ],
        10: ['backbone.layer3.1.conv1', 'backbone.layer3.1.conv2'] +
        R18_LAYER4 + [
            'decode_head.convs.0.conv', 'decode_head.convs.1.conv',
            'decode_head.conv_cat.conv'
        ],
    },
    'upernet_r18': {
        1: ['decode_head.fpn_bottleneck.conv'],
        5: ['decode_head.bottleneck.conv'] +
        [f'decode_head.fpn_convs.{i}.conv' for i in range(3)] +
        ['decode_head.fpn_bottleneck.conv'],
        10: ['decode_head.lateral_convs.2.conv'] + PSP +
        [f'decode_head.fpn_convs.{i}.conv' for i in range(3)] +
        ['decode_head.fpn_bottleneck.conv'],
    },
    'pspnet_mv2': {
        1: ['decode_head.bottleneck.conv'],
        5: PSP,
        10: ['backbone.layer6.2.conv.1.conv', 'backbone.layer6.2.conv.2.conv']
        + MV2_TAIL + PSP,
    },
    'deeplabv3_mv2': {
        1: ['decode_head.bottleneck.conv'],
        5: ASPP,
        10: ['backbone.layer6.2.conv.2.conv'] + MV2_TAIL +
        ['decode_head.image_pool.1.conv'] + ASPP,
    },
}


#: The six protocol models at the size and batch the accounting tests use.
SIX_MODELS = ('pspnet_r18', 'deeplabv3_r18', 'fcn_r18', 'upernet_r18',
              'pspnet_mv2', 'deeplabv3_mv2')
SMALL_SIZE = (64, 64)
SMALL_BATCH = 2


def model_cfg(name: str) -> dict:
    """An ``EncoderDecoder`` config for one of :data:`HEADS`."""
    parts = copy.deepcopy(HEADS[name])
    return dict(type='EncoderDecoder',
                data_preprocessor=copy.deepcopy(DATA_PREPROCESSOR),
                pretrained=None, train_cfg=dict(),
                test_cfg=dict(mode='whole'), **parts)


def build_model(name: str):
    """Build one of the test segmentors (registers mmseg modules)."""
    from mmseg.registry import MODELS
    from mmengine.config import ConfigDict
    from mmengine.registry import init_default_scope
    init_default_scope('mmseg')
    # ConfigDict, as from a config file: mmseg reads test_cfg.mode
    return MODELS.build(ConfigDict(model_cfg(name)))


def make_tiny_voc(root: str, num_train: int = 4, num_val: int = 2,
                  size: int = 64, seed: int = 0) -> str:
    """VOCdevkit/VOC2012 layout with random images and blob masks.

    Local on purpose: labels stay below :data:`NUM_CLASSES` so the tiny
    models (3 classes) can train on it. Returns the ``VOC2012`` directory.
    """
    from PIL import Image
    voc = osp.join(root, 'VOCdevkit', 'VOC2012')
    for sub in ('JPEGImages', 'SegmentationClass',
                osp.join('ImageSets', 'Segmentation')):
        os.makedirs(osp.join(voc, sub), exist_ok=True)
    rng = np.random.default_rng(seed)
    names = [f'{i:06d}' for i in range(num_train + num_val)]
    for name in names:
        img = rng.integers(0, 255, (size, size, 3), dtype=np.uint8)
        mask = np.zeros((size, size), np.uint8)
        y, x = rng.integers(0, size // 2, 2)
        mask[y:y + size // 2, x:x + size // 2] = rng.integers(
            1, NUM_CLASSES)
        img[mask > 0] //= 2
        Image.fromarray(img).save(osp.join(voc, 'JPEGImages', name + '.jpg'))
        Image.fromarray(mask, mode='P').save(
            osp.join(voc, 'SegmentationClass', name + '.png'))
    split = osp.join(voc, 'ImageSets', 'Segmentation')
    with open(osp.join(split, 'train.txt'), 'w') as f:
        f.write('\n'.join(names[:num_train]) + '\n')
    with open(osp.join(split, 'val.txt'), 'w') as f:
        f.write('\n'.join(names[num_train:]) + '\n')
    return voc


def runner_cfg(work_dir: str, voc_root: str, name: str = 'pspnet_r18',
               max_iters: int = 3, batch_size: int = 2) -> dict:
    """A minimal mmseg training config (dict) on the tiny VOC dataset.

    Plain SGD (lr 0.01, momentum 0.9, weight decay 5e-4: the paper's
    finetuning optimizer), iteration-based loop, a checkpoint at the end.
    """
    pipeline = [
        dict(type='LoadImageFromFile'),
        dict(type='LoadAnnotations'),
        dict(type='PackSegInputs'),
    ]
    return dict(
        default_scope='mmseg',
        work_dir=work_dir,
        model=model_cfg(name),
        data_preprocessor=copy.deepcopy(DATA_PREPROCESSOR),
        crop_size=(64, 64),
        train_dataloader=dict(
            batch_size=batch_size,
            num_workers=0,
            persistent_workers=False,
            sampler=dict(type='InfiniteSampler', shuffle=True),
            dataset=dict(
                type='PascalVOCDataset',
                data_root=voc_root,
                data_prefix=dict(img_path='JPEGImages',
                                 seg_map_path='SegmentationClass'),
                ann_file='ImageSets/Segmentation/train.txt',
                pipeline=pipeline)),
        train_cfg=dict(type='IterBasedTrainLoop', max_iters=max_iters,
                       val_interval=10**6),
        optim_wrapper=dict(
            type='OptimWrapper',
            optimizer=dict(type='SGD', lr=0.01, momentum=0.9,
                           weight_decay=5e-4)),
        default_hooks=dict(
            timer=dict(type='IterTimerHook'),
            logger=dict(type='LoggerHook', interval=1),
            param_scheduler=dict(type='ParamSchedulerHook'),
            checkpoint=dict(type='CheckpointHook', by_epoch=False,
                            interval=max_iters),
            sampler_seed=dict(type='DistSamplerSeedHook')),
        env_cfg=dict(cudnn_benchmark=False,
                     mp_cfg=dict(mp_start_method='fork', opencv_num_threads=0),
                     dist_cfg=dict(backend='gloo')),
        log_processor=dict(by_epoch=False),
        log_level='INFO',
        randomness=dict(seed=0),
        launcher='none')


def prepare_workspace(root: str) -> dict:
    """A tiny VOC dataset plus a fixed initial PSPNet-R18 checkpoint.

    Training runs start from ``init`` (``load_from``), so "which parameters
    changed" is measured against ``init_state``. The initial weights are a
    seeded init *plus noise*: a Runner seeded the same way builds the seeded
    init itself, so with plain seeded weights a checkpoint that silently
    failed to load (mmengine loads ``load_from`` with ``strict=False``)
    would look loaded.
    """
    import torch
    voc = make_tiny_voc(osp.join(root, 'data'), num_train=4, num_val=2,
                        size=64)
    torch.manual_seed(0)
    init = build_model('pspnet_r18')
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in init.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=gen))
    init_ckpt = osp.join(root, 'init.pth')
    torch.save({'state_dict': init.state_dict(), 'meta': {}}, init_ckpt)
    return dict(root=root, voc=voc, init=init_ckpt,
                init_state={k: v.clone()
                            for k, v in init.state_dict().items()})


def tool_cfg(work_dir: str, voc_root: str, init: str, way: str = 'rewrite',
             max_iters: int = 3, batch_size: int = 2, **hook_args) -> dict:
    """A ``tools/train.py`` config: PSPNet-R18, last 5 convs, r = 4.

    ``way='rewrite'``: ``gradient_filter=dict(...)``; ``'hook'``: an
    unchanged model config plus ``GradFilterHook``. Deterministic: no
    dropout (the ranks of a DDP run draw other masks than one process),
    frozen BN in eval, seeded shuffling, no random augmentation.
    """
    cfg = runner_cfg(work_dir, voc_root, max_iters=max_iters,
                     batch_size=batch_size)
    cfg['model']['decode_head']['dropout_ratio'] = 0.0
    cfg['train_dataloader']['sampler']['seed'] = 0
    cfg['custom_imports'] = dict(
        imports=['mmseg_gf', 'tests.helpers.train_hooks'],
        allow_failed_imports=False)
    cfg['load_from'] = init
    settings = dict(dict(num_layers=5, radius=4), **hook_args)
    if way == 'rewrite':
        cfg['gradient_filter'] = settings
        cfg['custom_hooks'] = []
    else:
        cfg['custom_hooks'] = [dict(type='GradFilterHook', **settings)]
    return cfg


def write_cfg(path: str, cfg: dict) -> str:
    """Dump a config dict to a ``.py`` file (as a user would write it)."""
    from mmengine.config import Config
    Config(copy.deepcopy(cfg)).dump(path)
    return path


def run_training(cfg_dict: dict, **extra):
    """Build a Runner (after ``rewrite_config``) and train; returns it."""
    from mmengine.config import Config
    from mmengine.runner import Runner

    from mmseg_gf.engine import rewrite_config
    cfg = Config(copy.deepcopy(cfg_dict))
    cfg.update(extra)
    runner = Runner.from_cfg(rewrite_config(cfg))
    runner.train()
    return runner


def gf_paths(model) -> list:
    """Module paths of the GFConv2d layers, in registration order."""
    from mmseg_gf.models import GFConv2d
    return [n for n, m in model.named_modules() if isinstance(m, GFConv2d)]


def changed_modules(state: dict, init_state: dict) -> set:
    """Owners (module paths) of state_dict entries that differ from init."""
    import torch
    return {
        k.rsplit('.', 1)[0]
        for k, v in state.items() if not torch.equal(v, init_state[k])
    }


def filtered_copy(base, num_layers: int, radius, size, **flags):
    """A copy of ``base`` with its last ``num_layers`` layers filtered at
    ``radius`` (selected on a ``size`` input); ``flags`` go to
    ``apply_gradient_filter`` (``mode``, ``lean``, ...)."""
    from mmseg_gf.engine import apply_gradient_filter, select_layers
    model = copy.deepcopy(base)
    choices = select_layers(model, num_layers=num_layers, radius=radius,
                            input_size=size)
    apply_gradient_filter(model, choices, **flags)
    return model


def step_saved_bytes(model, size, batch: int) -> int:
    """What autograd saves in one training step of ``model`` on a random
    ``batch x size`` batch."""
    from mmseg_gf.accounting.batch import random_batch, training_loss
    from mmseg_gf.accounting.measured import saved_tensor_bytes
    inputs, samples = random_batch(model, size, batch)
    return saved_tensor_bytes(lambda: training_loss(model, inputs, samples))
