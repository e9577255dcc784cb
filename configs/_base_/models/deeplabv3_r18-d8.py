# DeepLabV3 with a dilated (output stride 8) ResNetV1c-18: mmseg's
# configs/deeplabv3/deeplabv3_r18-d8_*.py (ASPP dilations 1/12/24/36,
# 512 -> 128 channels) without the auxiliary head; same conventions as
# pspnet_r18-d8.py (plain BN, random init, norm_eval=True for finetuning).
_base_ = ['mmseg::_base_/models/deeplabv3_r50-d8.py']
norm_cfg = dict(type='BN', requires_grad=True)
model = dict(
    pretrained=None,
    backbone=dict(depth=18, norm_cfg=norm_cfg, norm_eval=True),
    decode_head=dict(in_channels=512, channels=128, norm_cfg=norm_cfg),
    auxiliary_head=None)
