# FCN-R18 finetuned on VOC12Aug, "Ours, 5": the last 5 convs in execution
# order trained with gradient filtering, r=4 (the classifier exactly,
# everything else frozen), from the calibrated model
# (configs/calib/fcn_r18-d8_calib_1xb8-1k_voc12aug-512x512.py):
#   python tools/train.py configs/gf/fcn_r18-d8_gf-last5-r4_1xb8-20k_voc12aug-512x512.py \
#       --cfg-options load_from=<calibrated checkpoint>
_base_ = [
    '../_base_/models/fcn_r18-d8.py',
    '../_base_/datasets/voc12aug.py',
    '../_base_/default_runtime.py',
    '../_base_/strategies/gf_last5_r4.py'
]
model = dict(
    data_preprocessor=dict(size=_base_.crop_size),
    decode_head=dict(num_classes=_base_.num_classes))
