# Pascal VOC 2012 + SBD aug ("VOC12Aug", 1464 + 9118 train images, 1449 val):
# mmseg's pascal_voc12_aug.py unchanged. Train = ConcatDataset of
#   train.txt + SegmentationClass/    (palette PNGs) and
#   aug.txt   + SegmentationClassAug/ (grayscale ids, from mmseg's
#                                      tools/dataset_converters/voc_aug.py);
# val = val.txt + SegmentationClass/. Pipeline: random resize (2048x512,
# ratio 0.5-2), random crop 512x512 (cat_max_ratio 0.75), flip, photometric
# distortion, pad to 512.
#
# Layout: data/VOCdevkit/VOC2012/{JPEGImages, SegmentationClass,
# SegmentationClassAug, ImageSets/Segmentation/{train,val,aug}.txt}.
# `tools/make_dataset.py voc` writes the same layout with synthetic images.
#
# To move the data, override the datasets, not the `data_root` variable
# (mmengine does not re-evaluate base files); see configs/demo/ for how:
#   dataset_train = dict(_base_.dataset_train, data_root=..., pipeline=...)
_base_ = ['mmseg::_base_/datasets/pascal_voc12_aug.py']

# The paper's protocol (Supplement D.3): batch 8 on one device for both
# calibration and finetuning. `num_classes` is read by the concrete configs
# (`decode_head=dict(num_classes=_base_.num_classes)`).
num_classes = 21
train_dataloader = dict(batch_size=8)
