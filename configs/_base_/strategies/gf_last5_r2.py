# "Ours, 5": the last 5 convs in execution order trained with gradient
# filtering, patch size r=2 (the classifier is trained exactly).
_base_ = ['../schedules/finetune_20k_ref.py']
gradient_filter = dict(num_layers=5, radius=2, mode='gf',
                       layer_kinds=['conv2d'])
