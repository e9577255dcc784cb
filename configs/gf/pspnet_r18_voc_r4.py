# PSPNet-R18 (d8) finetuned on VOC12Aug (21 classes) with gradient filtering,
# radius 4, on the last 5 conv layers in execution order: the decode head's
# four PPM convs and its bottleneck. The classifier (conv_seg) is trained
# exactly and not counted; everything else is frozen (norms in eval mode).
# Batch 8 on one device, 20k iterations, SGD lr 0.01 with cosine decay after
# a 1000-iteration linear warm-up, gradient clipping at norm 1: the paper's
# Table 3 / Table 9 setting ("Ours", #Layers 5) with the reference
# implementation's schedule (_base_/schedules/finetune_20k_ref.py).
#
# The short name of pspnet_r18-d8_gf-last5-r4_1xb8-20k_voc12aug-512x512.py
# (the same bases, the same config); its siblings in this directory cover
# the other models, Cityscapes as the target and "Vanilla BP, 5"
# (`*_vanilla-last5_*`: the same layers with the exact backward).
#
# Random init by default; for the paper's transfer protocol start from a
# Cityscapes- or ADE20K-trained PSPNet-R18, calibrated on VOC12Aug
# (configs/calib/pspnet_r18-d8_calib_1xb8-1k_voc12aug-512x512.py):
#   python tools/train.py configs/gf/pspnet_r18_voc_r4.py \
#       --cfg-options load_from=<checkpoint>.pth
_base_ = [
    '../_base_/models/pspnet_r18-d8.py',
    '../_base_/datasets/voc12aug.py',
    '../_base_/default_runtime.py',
    '../_base_/strategies/gf_last5_r4.py'
]
model = dict(
    data_preprocessor=dict(size=_base_.crop_size),
    decode_head=dict(num_classes=_base_.num_classes))
