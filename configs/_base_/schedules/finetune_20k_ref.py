# finetune_20k.py (the paper: 20k iterations, SGD lr 0.01 momentum 0.9
# weight decay 5e-4, cosine annealing) with the two extras of the public
# reference implementation's finetune configs: a linear warm-up over the
# first 1000 iterations (from lr 1e-5) and gradient clipping (L2, max_norm 1).
# This is the schedule of every finetuning strategy in strategies/.
_base_ = ['./finetune_20k.py']
optim_wrapper = dict(clip_grad=dict(_delete_=True, max_norm=1, norm_type=2))
param_scheduler = [
    dict(
        type='LinearLR',
        start_factor=1e-3,
        begin=0,
        end=1000,
        by_epoch=False),
    dict(
        type='CosineAnnealingLR',
        T_max=19000,
        eta_min=0.0,
        begin=1000,
        end=20000,
        by_epoch=False)
]
default_hooks = dict(checkpoint=dict(max_keep_ckpts=1))
