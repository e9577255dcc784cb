# "Vanilla BP, 10": train the last 10 convs in execution order (plus the
# classifier) with the exact backward; everything else frozen.
_base_ = ['../schedules/finetune_20k_ref.py']
gradient_filter = dict(num_layers=10, mode='vanilla',
                       layer_kinds=['conv2d'])
