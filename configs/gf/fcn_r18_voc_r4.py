# FCN-R18 finetuned on VOC12Aug with gradient filtering: the
# last 5 convs in execution order, r=4 ("Ours, 5"), from the calibrated
# model (configs/calib/fcn_r18_voc.py):
#   python tools/train.py configs/gf/fcn_r18_voc_r4.py \
#       --cfg-options load_from=<calibrated checkpoint>
_base_ = [
    '../_base_/models/fcn_r18-d8.py', '../_base_/datasets/voc12aug.py',
    '../_base_/default_runtime.py', '../_base_/strategies/gf_last5_r4.py'
]
model = dict(
    data_preprocessor=dict(size=_base_.crop_size),
    decode_head=dict(num_classes=_base_.num_classes))
