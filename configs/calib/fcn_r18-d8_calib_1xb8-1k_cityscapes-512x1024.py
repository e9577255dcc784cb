# Calibration of FCN-R18 on Cityscapes (the "Calibration" rows of Tables 3 /
# 9): the classifier and the BN statistics, 1000 iterations, from an
# ADE20K-trained model:
#   python tools/train.py configs/calib/fcn_r18-d8_calib_1xb8-1k_cityscapes-512x1024.py \
#       --cfg-options load_from=<source checkpoint>
_base_ = [
    '../_base_/models/fcn_r18-d8.py',
    '../_base_/datasets/cityscapes.py',
    '../_base_/default_runtime.py',
    '../_base_/strategies/calibrate.py'
]
model = dict(
    data_preprocessor=dict(size=_base_.crop_size),
    decode_head=dict(num_classes=_base_.num_classes))
