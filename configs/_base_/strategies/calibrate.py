# Calibration (Supplement D.3): train the classifier (decode_head.conv_seg)
# and update the BN running statistics, everything else frozen, for 1000
# iterations. CalibrationHook (mmseg_gf.engine.hooks) freezes the rest
# and keeps every BN layer in train mode (statistics update) while their
# affine parameters stay frozen.
_base_ = ['../schedules/calibrate_1k.py']
custom_hooks = [
    dict(type='CalibrationHook', trainable=['decode_head.conv_seg'])
]
