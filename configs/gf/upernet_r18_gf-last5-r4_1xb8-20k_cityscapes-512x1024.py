# UPerNet-R18 finetuned on Cityscapes, "Ours, 5": the last 5 convs in
# execution order trained with gradient filtering, r=4 (the classifier
# exactly, everything else frozen), from the calibrated model
# (configs/calib/upernet_r18_calib_1xb8-1k_cityscapes-512x1024.py):
#   python tools/train.py configs/gf/upernet_r18_gf-last5-r4_1xb8-20k_cityscapes-512x1024.py \
#       --cfg-options load_from=<calibrated checkpoint>
_base_ = [
    '../_base_/models/upernet_r18.py',
    '../_base_/datasets/cityscapes.py',
    '../_base_/default_runtime.py',
    '../_base_/strategies/gf_last5_r4.py'
]
model = dict(
    data_preprocessor=dict(size=_base_.crop_size),
    decode_head=dict(num_classes=_base_.num_classes))
