# Calibration of the MobileNetV2 models (Supplement D.3): the whole decoder
# (decode_head, classifier included) and the BN statistics, 5000 iterations.
_base_ = ['../schedules/calibrate_5k.py']
custom_hooks = [dict(type='CalibrationHook', trainable=['decode_head'])]
