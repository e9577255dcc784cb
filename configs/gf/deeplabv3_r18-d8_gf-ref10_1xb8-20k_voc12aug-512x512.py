# DeepLabV3-R18 finetuned on VOC12Aug with the public reference
# implementation's "10 layers" and per-layer radii
# (configs/_base_/strategies/reference/deeplabv3_r18_10.py),
# from the calibrated model
# (configs/calib/deeplabv3_r18-d8_calib_1xb8-1k_voc12aug-512x512.py).
_base_ = [
    '../_base_/models/deeplabv3_r18-d8.py', '../_base_/datasets/voc12aug.py',
    '../_base_/default_runtime.py',
    '../_base_/strategies/reference/deeplabv3_r18_10.py'
]
model = dict(
    data_preprocessor=dict(size=_base_.crop_size),
    decode_head=dict(num_classes=_base_.num_classes))
