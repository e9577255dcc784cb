# PSPNet-R18 (d8) finetuned on VOC12Aug (21 classes) with gradient filtering,
# radius 4, on the last 5 conv layers in execution order: the decode head's
# four PPM convs and its bottleneck. The classifier (conv_seg) is trained
# exactly and not counted; everything else is frozen (norms in eval mode).
# Batch 8 on one device, 20k iterations, SGD lr 0.01 cosine: the paper's
# Table 3 / Table 9 setting ("Ours", #Layers 5). mode='vanilla' trains the
# same layers with the exact backward ("Vanilla BP 5").
#
# Random init by default; for the paper's transfer protocol start from a
# Cityscapes- or ADE20K-trained PSPNet-R18:
#   python tools/train.py configs/gf/pspnet_r18_voc_r4.py \
#       --cfg-options load_from=<checkpoint>.pth
_base_ = [
    '../_base_/models/pspnet_r18-d8.py', '../_base_/datasets/voc12aug.py',
    '../_base_/default_runtime.py', '../_base_/schedules/finetune_20k.py'
]
crop_size = (512, 512)
data_preprocessor = dict(size=crop_size)
model = dict(
    data_preprocessor=data_preprocessor,
    decode_head=dict(num_classes=21))
train_dataloader = dict(batch_size=8)
gradient_filter = dict(num_layers=5, radius=4, mode='gf')
