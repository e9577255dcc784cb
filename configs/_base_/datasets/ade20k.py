# ADE20K (SceneParsing / ADEChallengeData2016, 20210 train / 2000 val
# images, 150 classes, label 0 "other" ignored by reduce_zero_label):
# mmseg's ade20k.py unchanged (random resize 2048x512 ratio 0.5-2, random
# crop 512x512, flip, photometric distortion) plus the paper's batch size 8.
#
# Layout (mmseg docs, dataset_prepare.md):
#   data/ade/ADEChallengeData2016/images/{training,validation}/*.jpg
#   data/ade/ADEChallengeData2016/annotations/{training,validation}/*.png
# `tools/make_dataset.py ade20k` writes the same layout, synthetic.
_base_ = ['mmseg::_base_/datasets/ade20k.py']
num_classes = 150
train_dataloader = dict(batch_size=8)
