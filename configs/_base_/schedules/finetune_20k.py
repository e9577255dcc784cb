# The paper's finetuning schedule (Supplement D.3): 20k iterations of SGD,
# lr 0.01, momentum 0.9, weight decay 5e-4, cosine annealing.
# Gradient clipping is off; enable it with
#   --cfg-options optim_wrapper.clip_grad.max_norm=1
# (or `optim_wrapper = dict(clip_grad=dict(max_norm=1, norm_type=2))`).
optimizer = dict(type='SGD', lr=0.01, momentum=0.9, weight_decay=0.0005)
optim_wrapper = dict(type='OptimWrapper', optimizer=optimizer, clip_grad=None)
param_scheduler = [
    dict(
        type='CosineAnnealingLR',
        T_max=20000,
        eta_min=0.0,
        begin=0,
        end=20000,
        by_epoch=False)
]
train_cfg = dict(type='IterBasedTrainLoop', max_iters=20000, val_interval=2000)
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')
default_hooks = dict(
    timer=dict(type='IterTimerHook'),
    logger=dict(type='LoggerHook', interval=50, log_metric_by_epoch=False),
    param_scheduler=dict(type='ParamSchedulerHook'),
    checkpoint=dict(type='CheckpointHook', by_epoch=False, interval=2000),
    sampler_seed=dict(type='DistSamplerSeedHook'),
    visualization=dict(type='SegVisualizationHook'))
