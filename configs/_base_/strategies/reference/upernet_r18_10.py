# The public reference implementation's UPerNet-R18 "10 layers" (its list
# has 8 convs): fpn_bottleneck r=8, fpn_convs.0/1/2 r=8/4/2,
# lateral_convs.0/1/2 r=8/4/2 (strides 4/8/16), the PPM bottleneck r=2.
# The PPM convs are not trained. 'auto' gives the same radii by stride.
_base_ = ['../../schedules/finetune_20k_ref.py']
gradient_filter = dict(
    layers=[
        'decode_head.lateral_convs', 'decode_head.bottleneck',
        'decode_head.fpn_convs', 'decode_head.fpn_bottleneck'
    ],
    radius={
        'decode_head.fpn_bottleneck': 8,
        'decode_head.fpn_convs.0': 8,
        'decode_head.fpn_convs.1': 4,
        'decode_head.fpn_convs.2': 2,
        'decode_head.lateral_convs.0': 8,
        'decode_head.lateral_convs.1': 4,
        'decode_head.lateral_convs.2': 2,
        'decode_head.bottleneck': 2,
    },
    mode='gf')
