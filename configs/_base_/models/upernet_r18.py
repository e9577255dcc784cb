# UPerNet with a ResNetV1c-18 (not dilated: strides 4/8/16/32): mmseg's
# configs/upernet/upernet_r18_*.py (in_channels 64/128/256/512, 512-channel
# head) without the auxiliary head; same conventions as pspnet_r18-d8.py.
_base_ = ['mmseg::_base_/models/upernet_r50.py']
norm_cfg = dict(type='BN', requires_grad=True)
model = dict(
    pretrained=None,
    backbone=dict(depth=18, norm_cfg=norm_cfg, norm_eval=True),
    decode_head=dict(in_channels=[64, 128, 256, 512], norm_cfg=norm_cfg),
    auxiliary_head=None)
