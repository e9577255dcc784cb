# Calibration (Supplement D.3): 1000 iterations of SGD, lr 0.01, momentum
# 0.9, weight decay 5e-4, exponential decay (gamma 0.995: lr 6.7e-5 at the
# end). What is trained is set by the strategy (strategies/calibrate.py:
# the classifier and the BN statistics). One validation at the end.
_base_ = ['./sgd_iter_based.py']
param_scheduler = [
    dict(type='ExponentialLR', gamma=0.995, begin=0, end=1000, by_epoch=False)
]
train_cfg = dict(type='IterBasedTrainLoop', max_iters=1000, val_interval=1000)
default_hooks = dict(checkpoint=dict(interval=1000, max_keep_ckpts=1))
