# UPerNet-R18 finetuned on VOC12Aug, "Vanilla BP, 5": the last 5 convs in
# execution order trained with the exact backward (the classifier too,
# everything else frozen), from the calibrated model
# (configs/calib/upernet_r18_calib_1xb8-1k_voc12aug-512x512.py):
#   python tools/train.py configs/gf/upernet_r18_vanilla-last5_1xb8-20k_voc12aug-512x512.py \
#       --cfg-options load_from=<calibrated checkpoint>
_base_ = [
    '../_base_/models/upernet_r18.py',
    '../_base_/datasets/voc12aug.py',
    '../_base_/default_runtime.py',
    '../_base_/strategies/vanilla_last5.py'
]
model = dict(
    data_preprocessor=dict(size=_base_.crop_size),
    decode_head=dict(num_classes=_base_.num_classes))
