# What every schedule here shares: SGD (lr 0.01, momentum 0.9, weight decay
# 5e-4, the paper's settings for calibration and finetuning and mmseg's
# usual ones), iteration-based loops and mmseg's default hooks with
# iteration-based checkpoints. Each schedule adds its learning-rate shape,
# its length and its checkpoint interval.
optimizer = dict(type='SGD', lr=0.01, momentum=0.9, weight_decay=0.0005)
optim_wrapper = dict(type='OptimWrapper', optimizer=optimizer, clip_grad=None)
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')
default_hooks = dict(
    timer=dict(type='IterTimerHook'),
    logger=dict(type='LoggerHook', interval=50, log_metric_by_epoch=False),
    param_scheduler=dict(type='ParamSchedulerHook'),
    checkpoint=dict(type='CheckpointHook', by_epoch=False),
    sampler_seed=dict(type='DistSamplerSeedHook'),
    visualization=dict(type='SegVisualizationHook'))
