"""A tiny mmseg EncoderDecoder around a test backbone: FCN heads with
plain cross-entropy, no dropout, whole-image inference."""
import torch
from mmengine.config import ConfigDict
from mmengine.registry import init_default_scope
from mmseg.registry import MODELS

BN = dict(type='BN', requires_grad=True)


def fcn_head(in_channels: int, channels: int, loss_weight: float = 1.0):
    return dict(type='FCNHead', in_channels=in_channels, channels=channels,
                num_convs=1, concat_input=False, num_classes=3, norm_cfg=BN,
                dropout_ratio=0.0,
                loss_decode=dict(type='CrossEntropyLoss',
                                 loss_weight=loss_weight))


def tiny_segmentor(backbone: str, size, decode_head: dict,
                   auxiliary_head: dict = None):
    """``backbone`` (a registered type) with the given heads, seeded."""
    init_default_scope('mmseg')
    torch.manual_seed(0)
    cfg = dict(
        type='EncoderDecoder',
        data_preprocessor=dict(type='SegDataPreProcessor', size=size,
                               mean=[0., 0., 0.], std=[1., 1., 1.]),
        backbone=dict(type=backbone), decode_head=decode_head,
        train_cfg=dict(), test_cfg=dict(mode='whole'))
    if auxiliary_head is not None:
        cfg['auxiliary_head'] = auxiliary_head
    return MODELS.build(ConfigDict(cfg))
