# "Ours, 10": the last 10 convs in execution order trained with gradient
# filtering, patch size r=4 (the classifier is trained exactly).
_base_ = ['../schedules/finetune_20k_ref.py']
gradient_filter = dict(num_layers=10, radius=4, mode='gf',
                       layer_kinds=['conv2d'])
