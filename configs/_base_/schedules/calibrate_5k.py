# Calibration of the MobileNetV2 models (Supplement D.3): 5000 iterations,
# otherwise as calibrate_1k.py (gamma 0.999: the same total decay, lr 6.7e-5
# at the end).
_base_ = ['./calibrate_1k.py']
param_scheduler = [
    dict(type='ExponentialLR', gamma=0.999, begin=0, end=5000, by_epoch=False)
]
train_cfg = dict(max_iters=5000, val_interval=5000)
default_hooks = dict(checkpoint=dict(interval=5000))
