# The public reference implementation's PSPNet-R18 "5 layers": the decode
# head (4 PPM convs + bottleneck), r=4. Same convs as gf_last5_r4.py.
_base_ = ['../../schedules/finetune_20k_ref.py']
gradient_filter = dict(
    layers=['decode_head.psp_modules', 'decode_head.bottleneck'],
    radius=4,
    mode='gf')
