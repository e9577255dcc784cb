# The public reference implementation's FCN-R18 "10 layers": conv_cat,
# convs.0/1, backbone.layer4 (both blocks and the downsample conv) and
# backbone.layer3.1, r=2. Same convs as gf_last10_r2.py.
_base_ = ['../../schedules/finetune_20k_ref.py']
gradient_filter = dict(
    layers=[
        'backbone.layer3.1', 'backbone.layer4', 'decode_head.convs',
        'decode_head.conv_cat'
    ],
    radius=2,
    mode='gf')
