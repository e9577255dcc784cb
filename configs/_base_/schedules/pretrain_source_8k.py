# Offline stand-in for a model-zoo checkpoint: train a randomly initialised
# segmentor on the *source* dataset (tools/run_protocol.py does this when no
# --source-checkpoint is given). mmseg's usual poly schedule (SGD lr 0.01,
# momentum 0.9, weight decay 5e-4, power 0.9, eta_min 1e-4), 8000
# iterations: short next to mmseg's 80k-160k, enough for a usable source
# model on the synthetic data; on real data prefer the mmseg checkpoints.
_base_ = ['./sgd_iter_based.py']
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
default_hooks = dict(checkpoint=dict(interval=2000, max_keep_ckpts=1))
