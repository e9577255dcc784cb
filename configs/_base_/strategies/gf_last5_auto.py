# "Ours, 5" with the 'auto' radius: r from each layer's output stride
# (<=4: 8, 8: 4, >=16: 2; see mmseg_gf.engine.selection.auto_radius).
_base_ = ['../schedules/finetune_20k_ref.py']
gradient_filter = dict(num_layers=5, radius='auto', mode='gf',
                       layer_kinds=['conv2d'])
