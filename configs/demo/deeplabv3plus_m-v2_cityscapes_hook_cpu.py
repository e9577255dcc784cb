# mmseg's DeepLabV3+ MobileNetV2 Cityscapes config as it comes, with
# GradFilterHook (last 5 layers, radius 4), on the synthetic Cityscapes of
#   python tools/make_dataset.py cityscapes --out data/cityscapes_syn
# Offline and small on CPU:
#   python tools/benchmark_runner_compile.py \
#       configs/demo/deeplabv3plus_m-v2_cityscapes_hook_cpu.py \
#       --offline --crop 64 128
_base_ = ('mmseg::mobilenet_v2/'
          'mobilenet-v2-d8_deeplabv3plus_4xb2-80k_cityscapes-512x1024.py')
custom_imports = dict(imports=['mmseg_gf'], allow_failed_imports=False)
custom_hooks = [dict(type='GradFilterHook', num_layers=5, radius=4)]
data_root = 'data/cityscapes_syn'
train_dataloader = dict(dataset=dict(data_root=data_root))
val_dataloader = dict(dataset=dict(data_root=data_root))
test_dataloader = val_dataloader
