# PSPNet with a dilated (output stride 8) MobileNetV2: mmseg's
# configs/mobilenet_v2/mobilenet-v2-d8_pspnet_*.py (decode head 320 -> 512
# channels) without the auxiliary head; plain BN, random init
# (model.pretrained='mmcls://mobilenet_v2' for an ImageNet backbone),
# norm_eval=True as the reference finetune configs.
_base_ = ['mmseg::_base_/models/pspnet_r50-d8.py']
norm_cfg = dict(type='BN', requires_grad=True)
model = dict(
    pretrained=None,
    backbone=dict(
        _delete_=True,
        type='MobileNetV2',
        widen_factor=1.,
        strides=(1, 2, 2, 1, 1, 1, 1),
        dilations=(1, 1, 1, 2, 2, 4, 4),
        out_indices=(1, 2, 4, 6),
        norm_cfg=norm_cfg,
        norm_eval=True),
    decode_head=dict(in_channels=320, norm_cfg=norm_cfg),
    auxiliary_head=None)
