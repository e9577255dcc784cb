# Calibration of PSPNet-MobileNetV2 on VOC12Aug (the "Calibration" rows of
# Tables 3 / 9): the decoder and the BN statistics, 5000 iterations, from a
# Cityscapes- or ADE20K-trained model:
#   python tools/train.py configs/calib/pspnet_m-v2-d8_calib_1xb8-5k_voc12aug-512x512.py \
#       --cfg-options load_from=<source checkpoint>
_base_ = [
    '../_base_/models/pspnet_m-v2-d8.py',
    '../_base_/datasets/voc12aug.py',
    '../_base_/default_runtime.py',
    '../_base_/strategies/calibrate_decoder.py'
]
model = dict(
    data_preprocessor=dict(size=_base_.crop_size),
    decode_head=dict(num_classes=_base_.num_classes))
