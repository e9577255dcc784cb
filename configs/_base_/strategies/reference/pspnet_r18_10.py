# The public reference implementation's PSPNet-R18 "10 layers": the decode
# head and backbone.layer4 (both blocks, 5 convs with the downsample), r=4.
# Same convs as gf_last10_r4.py.
_base_ = ['./pspnet_r18_5.py']
gradient_filter = dict(layers=[
    'backbone.layer4', 'decode_head.psp_modules', 'decode_head.bottleneck'
])
