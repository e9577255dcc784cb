# Cityscapes (fine annotations, 2975 train / 500 val images, 19 train ids):
# mmseg's cityscapes.py unchanged (random resize 2048x1024 ratio 0.5-2,
# random crop 512x1024 with cat_max_ratio 0.75, flip, photometric
# distortion; val at 2048x1024) plus the paper's batch size 8.
#
# Layout (mmseg docs, dataset_prepare.md; labelTrainIds written by mmseg's
# tools/dataset_converters/cityscapes.py):
#   data/cityscapes/leftImg8bit/{train,val}/<city>/*_leftImg8bit.png
#   data/cityscapes/gtFine/{train,val}/<city>/*_gtFine_labelTrainIds.png
# `tools/make_dataset.py cityscapes` writes the same layout, synthetic.
_base_ = ['mmseg::_base_/datasets/cityscapes.py']
num_classes = 19
train_dataloader = dict(batch_size=8)
