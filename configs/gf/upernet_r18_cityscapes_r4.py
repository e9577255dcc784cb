# UPerNet-R18 finetuned on Cityscapes with gradient filtering: the
# last 5 convs in execution order, r=4 ("Ours, 5"), from the calibrated
# model (configs/calib/upernet_r18_cityscapes.py):
#   python tools/train.py configs/gf/upernet_r18_cityscapes_r4.py \
#       --cfg-options load_from=<calibrated checkpoint>
_base_ = [
    '../_base_/models/upernet_r18.py', '../_base_/datasets/cityscapes.py',
    '../_base_/default_runtime.py', '../_base_/strategies/gf_last5_r4.py'
]
model = dict(
    data_preprocessor=dict(size=_base_.crop_size),
    decode_head=dict(num_classes=_base_.num_classes))
