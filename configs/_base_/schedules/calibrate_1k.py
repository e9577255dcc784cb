# Calibration (Supplement D.3): 1000 iterations of SGD, lr 0.01, momentum
# 0.9, weight decay 5e-4, exponential decay (gamma 0.995: lr 6.7e-5 at the
# end). What is trained is set by the strategy (strategies/calibrate.py:
# the classifier and the BN statistics). One validation at the end.
optimizer = dict(type='SGD', lr=0.01, momentum=0.9, weight_decay=0.0005)
optim_wrapper = dict(type='OptimWrapper', optimizer=optimizer, clip_grad=None)
param_scheduler = [
    dict(type='ExponentialLR', gamma=0.995, begin=0, end=1000, by_epoch=False)
]
train_cfg = dict(type='IterBasedTrainLoop', max_iters=1000, val_interval=1000)
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')
default_hooks = dict(
    timer=dict(type='IterTimerHook'),
    logger=dict(type='LoggerHook', interval=50, log_metric_by_epoch=False),
    param_scheduler=dict(type='ParamSchedulerHook'),
    checkpoint=dict(
        type='CheckpointHook', by_epoch=False, interval=1000,
        max_keep_ckpts=1),
    sampler_seed=dict(type='DistSamplerSeedHook'),
    visualization=dict(type='SegVisualizationHook'))
