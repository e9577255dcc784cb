# Offline stand-in for a model-zoo checkpoint: train a randomly initialised
# segmentor on the *source* dataset (tools/run_pipeline.py does this when no
# --source-checkpoint is given). mmseg's usual poly schedule (SGD lr 0.01,
# momentum 0.9, weight decay 5e-4, power 0.9, eta_min 1e-4), 8000
# iterations: short next to mmseg's 80k-160k, enough for a usable source
# model on the synthetic data; on real data prefer the mmseg checkpoints.
optimizer = dict(type='SGD', lr=0.01, momentum=0.9, weight_decay=0.0005)
optim_wrapper = dict(type='OptimWrapper', optimizer=optimizer, clip_grad=None)
param_scheduler = [
    dict(
        type='PolyLR',
        eta_min=1e-4,
        power=0.9,
        begin=0,
        end=8000,
        by_epoch=False)
]
train_cfg = dict(type='IterBasedTrainLoop', max_iters=8000, val_interval=8000)
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')
default_hooks = dict(
    timer=dict(type='IterTimerHook'),
    logger=dict(type='LoggerHook', interval=50, log_metric_by_epoch=False),
    param_scheduler=dict(type='ParamSchedulerHook'),
    checkpoint=dict(
        type='CheckpointHook', by_epoch=False, interval=2000,
        max_keep_ckpts=1),
    sampler_seed=dict(type='DistSamplerSeedHook'),
    visualization=dict(type='SegVisualizationHook'))
