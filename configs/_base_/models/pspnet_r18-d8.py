# PSPNet with a dilated (output stride 8) ResNetV1c-18 backbone: mmseg's
# configs/pspnet/pspnet_r18-d8_*.py (depth 18, decode head 512 -> 128
# channels) without the auxiliary FCN head (the paper finetunes the main
# branch only).
#
# Differences from mmseg's file (single-process, offline, finetuning):
# * norm_cfg BN instead of SyncBN. (mmengine's Runner reverts SyncBN to BN
#   outside distributed runs anyway; set SyncBN here for multi-GPU jobs.)
# * pretrained=None: random init, no download. For the paper's protocol set
#   `load_from` to a trained segmentor (e.g. mmseg's Cityscapes PSPNet-R18)
#   or `model.pretrained='open-mmlab://resnet18_v1c'` for an ImageNet backbone.
# * norm_eval=True: the backbone's BN statistics stay fixed while finetuning,
#   as in the reference finetune configs (calibration updates them through
#   CalibrationHook, training from scratch needs norm_eval=False).
_base_ = ['mmseg::_base_/models/pspnet_r50-d8.py']
norm_cfg = dict(type='BN', requires_grad=True)
model = dict(
    pretrained=None,
    backbone=dict(depth=18, norm_cfg=norm_cfg, norm_eval=True),
    decode_head=dict(in_channels=512, channels=128, norm_cfg=norm_cfg),
    auxiliary_head=None)
