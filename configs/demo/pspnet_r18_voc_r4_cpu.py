# CPU demo of configs/gf/pspnet_r18_voc_r4.py (what `make demo` runs through
# tools/demo.py): the same model and gradient filter (last 5 convs, radius 4),
# SGD with cosine decay, on the small synthetic VOC12Aug written by
#   python tools/make_dataset.py voc --out data/demo --num-train 96 \
#       --num-val 24 --size 96 128 --classes 1 2 3 4 5
# (tools/demo.py writes it when missing; label ids stay valid for VOC's 21
# classes, mIoU averages over the classes present). 96x128 images, 96x96
# crops, batch 4, 600 iterations, one validation at the end: about 1.5
# minutes of training on 2 idle CPU cores.
#
# lr 0.1 instead of the paper's 0.01: the paper finetunes a trained model;
# here the frozen backbone is randomly initialised (its output features are
# small, std ~0.15) and only the decode head learns. At 0.01 the model
# predicts nothing but background within a CPU budget.
_base_ = ['../gf/pspnet_r18_voc_r4.py']

data_root = 'data/demo/VOCdevkit/VOC2012'
img_scale = (128, 96)  # (w, h) of the generated images
crop_size = (96, 96)
max_iters = 600

train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations'),
    dict(
        type='RandomResize',
        scale=img_scale,
        ratio_range=(0.75, 1.5),
        keep_ratio=True),
    dict(type='RandomCrop', crop_size=crop_size, cat_max_ratio=0.75),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PhotoMetricDistortion'),
    dict(type='Pad', size=crop_size),
    dict(type='PackSegInputs')
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=img_scale, keep_ratio=True),
    dict(type='LoadAnnotations'),
    dict(type='PackSegInputs')
]

# mmseg's VOC12Aug datasets (train.txt + SegmentationClass, aug.txt +
# SegmentationClassAug), moved to data_root with the small pipeline.
dataset_train = dict(
    _base_.dataset_train, data_root=data_root, pipeline=train_pipeline)
dataset_aug = dict(
    _base_.dataset_aug, data_root=data_root, pipeline=train_pipeline)
train_dataloader = dict(
    batch_size=4,
    num_workers=2,
    dataset=dict(datasets=[dataset_train, dataset_aug]))
val_dataloader = dict(
    num_workers=1,
    persistent_workers=False,
    dataset=dict(data_root=data_root, pipeline=test_pipeline))
test_dataloader = val_dataloader

data_preprocessor = dict(size=crop_size)
model = dict(data_preprocessor=data_preprocessor)

# The paper's plain schedule: the base's gradient clipping and warm-up (the
# reference implementation's, in every finetuning strategy) are dropped here
# (clip_grad=None; param_scheduler below replaces the whole list).
optim_wrapper = dict(optimizer=dict(lr=0.1), clip_grad=None)
param_scheduler = [
    dict(
        type='CosineAnnealingLR',
        T_max=max_iters,
        eta_min=0.0,
        begin=0,
        end=max_iters,
        by_epoch=False)
]
train_cfg = dict(max_iters=max_iters, val_interval=max_iters)
default_hooks = dict(
    logger=dict(interval=20),
    checkpoint=dict(interval=max_iters, max_keep_ckpts=1),
    visualization=dict(draw=False))
env_cfg = dict(cudnn_benchmark=False)
