# The paper's finetuning schedule (Supplement D.3): 20k iterations of SGD,
# lr 0.01, momentum 0.9, weight decay 5e-4, cosine annealing.
# Gradient clipping is off; enable it with
#   --cfg-options optim_wrapper.clip_grad.max_norm=1
# (or `optim_wrapper = dict(clip_grad=dict(max_norm=1, norm_type=2))`).
_base_ = ['./sgd_iter_based.py']
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
default_hooks = dict(checkpoint=dict(interval=2000))
