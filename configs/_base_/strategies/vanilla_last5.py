# "Vanilla BP, 5": train the last 5 convs in execution order (plus the
# classifier) with the exact backward; everything else frozen.
_base_ = ['../schedules/finetune_20k_ref.py']
gradient_filter = dict(num_layers=5, mode='vanilla',
                       layer_kinds=['conv2d'])
