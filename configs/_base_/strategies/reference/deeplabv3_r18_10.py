# The public reference implementation's DeepLabV3-R18 "10 layers": ASPP
# branches 0-3 (dilations 1/12/24/36) at r=3/3/6/9, the bottleneck at r=3
# and backbone.layer4 (5 convs) at r=2. The image-pool branch is not
# trained (last-10 by execution order takes it instead of layer4.0.conv1).
_base_ = ['../../schedules/finetune_20k_ref.py']
gradient_filter = dict(
    layers=[
        'backbone.layer4', 'decode_head.aspp_modules', 'decode_head.bottleneck'
    ],
    radius={
        'backbone.layer4': 2,
        'decode_head.aspp_modules.0': 3,
        'decode_head.aspp_modules.1': 3,
        'decode_head.aspp_modules.2': 6,
        'decode_head.aspp_modules.3': 9,
        'decode_head.bottleneck': 3,
    },
    mode='gf')
