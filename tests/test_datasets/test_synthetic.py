"""The synthetic datasets are read by mmseg's real dataset classes and
configs unchanged, and their labels are learnable from appearance."""
import os.path as osp

import numpy as np
import pytest
from PIL import Image

from mmseg_gf.datasets import (class_appearance, make_ade20k, make_cityscapes,
                               make_voc_aug, voc_palette)

pytest.importorskip('mmseg')
from mmengine.config import Config  # noqa: E402
from mmengine.registry import init_default_scope  # noqa: E402
from tests.helpers.tools import REPO  # noqa: E402

VOC_CFG = osp.join(REPO, 'configs', '_base_', 'datasets', 'voc12aug.py')
MMSEG_DATASETS = osp.join(
    osp.dirname(__import__('mmseg').__file__), '.mim', 'configs', '_base_',
    'datasets')
LOAD = [dict(type='LoadImageFromFile'), dict(type='LoadAnnotations')]


def build(dataset_cfg: dict, data_root: str):
    """Build a dataset of a real config, moved to ``data_root``, with a
    pipeline that only loads (no random crop), so labels are comparable."""
    from mmseg.registry import DATASETS
    init_default_scope('mmseg')
    cfg = dict(dataset_cfg, data_root=data_root, pipeline=LOAD)
    cfg.pop('_scope_', None)
    return DATASETS.build(cfg)


def labels_of(dataset) -> np.ndarray:
    return np.stack([dataset[i]['gt_seg_map'] for i in range(len(dataset))])


@pytest.fixture(scope='module')
def voc_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp('voc'))
    make_voc_aug(root, num_train=6, num_val=4, size=(48, 64), seed=1,
                 num_aug=5)
    return osp.join(root, 'VOCdevkit', 'VOC2012')


@pytest.fixture(scope='module')
def city_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp('cityscapes'))
    make_cityscapes(root, num_train=5, num_val=3, size=(32, 64), seed=2)
    return root


@pytest.fixture(scope='module')
def ade_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp('ade'))
    make_ade20k(root, num_train=5, num_val=3, size=(48, 48), seed=3)
    return osp.join(root, 'ADEChallengeData2016')


def test_voc_files_like_real_voc(voc_root):
    sets = osp.join(voc_root, 'ImageSets', 'Segmentation')
    names = {
        s: open(osp.join(sets, s + '.txt')).read().split()
        for s in ('train', 'val', 'aug')
    }
    assert [len(names[s]) for s in ('train', 'val', 'aug')] == [6, 4, 5]
    # aug.txt excludes train and val, like mmseg's voc_aug.py converter.
    assert not set(names['aug']) & (set(names['train']) | set(names['val']))
    for name in names['train'] + names['val']:
        png = Image.open(osp.join(voc_root, 'SegmentationClass', name +
                                  '.png'))
        assert png.mode == 'P'
        assert png.getpalette()[:3 * 256] == voc_palette()
        aug = Image.open(osp.join(voc_root, 'SegmentationClassAug',
                                  name + '.png'))
        assert aug.mode == 'L'
        # Palette indices are the label ids: both files hold the same map.
        np.testing.assert_array_equal(np.array(png), np.array(aug))
    for name in names['aug']:
        assert osp.isfile(osp.join(voc_root, 'JPEGImages', name + '.jpg'))
        assert osp.isfile(
            osp.join(voc_root, 'SegmentationClassAug', name + '.png'))
        assert not osp.exists(
            osp.join(voc_root, 'SegmentationClass', name + '.png'))


def test_voc12aug_config_reads_it(voc_root):
    cfg = Config.fromfile(VOC_CFG)
    parts = cfg.train_dataloader.dataset.datasets
    assert cfg.train_dataloader.dataset.type == 'ConcatDataset'
    train = [build(d, voc_root) for d in parts]
    val = build(cfg.val_dataloader.dataset, voc_root)
    assert [len(d) for d in train] == [6, 5]
    assert len(val) == 4
    assert len(val.metainfo['classes']) == 21
    for ds in train + [val]:
        labels = labels_of(ds)
        assert labels.shape[1:] == (48, 64)
        values = set(np.unique(labels).tolist())
        assert values <= set(range(21)) | {255}
        assert 0 in values and 255 in values  # background and borders
        assert values & set(range(1, 21))  # some objects
        # Every image has background and at least one object.
        for lab in labels:
            assert (lab == 0).any() and ((lab > 0) & (lab < 255)).any()


def train_and_val(config_name: str, data_root: str):
    """The train and val datasets of one of mmseg's dataset configs."""
    cfg = Config.fromfile(osp.join(MMSEG_DATASETS, config_name))
    return (build(cfg.train_dataloader.dataset, data_root),
            build(cfg.val_dataloader.dataset, data_root))


def test_cityscapes_config_reads_it(city_root):
    train, val = train_and_val('cityscapes.py', city_root)
    assert (len(train), len(val)) == (5, 3)
    assert len(train.metainfo['classes']) == 19
    name = osp.basename(train.get_data_info(0)['seg_map_path'])
    assert name.endswith('_gtFine_labelTrainIds.png')
    for ds in (train, val):
        labels = labels_of(ds)
        assert labels.shape[1:] == (32, 64)
        values = set(np.unique(labels).tolist())
        assert values <= set(range(19)) | {255}
        assert len(values - {255}) >= 3


def test_ade20k_config_reads_it(ade_root):
    train, val = train_and_val('ade20k.py', ade_root)
    assert (len(train), len(val)) == (5, 3)
    assert len(train.metainfo['classes']) == 150
    raw = np.array(
        Image.open(train.get_data_info(0)['seg_map_path']))
    assert raw.min() == 0 and raw.max() <= 150  # 0 = "other" on disk
    for ds in (train, val):
        labels = labels_of(ds)  # reduce_zero_label: 0 -> 255, k -> k - 1
        values = set(np.unique(labels).tolist())
        assert values <= set(range(150)) | {255}
        assert 255 in values and len(values - {255}) >= 2


def test_deterministic_and_seeded(tmp_path):
    a, b, c = (str(tmp_path / n) for n in 'abc')
    make_cityscapes(a, 2, 1, size=(24, 32), seed=5)
    make_cityscapes(b, 2, 1, size=(24, 32), seed=5)
    make_cityscapes(c, 2, 1, size=(24, 32), seed=6)
    rel = osp.join('gtFine', 'train', 'aachen',
                   'aachen_000000_000019_gtFine_labelTrainIds.png')
    img_rel = osp.join('leftImg8bit', 'train', 'aachen',
                       'aachen_000000_000019_leftImg8bit.png')
    for path in (rel, img_rel):
        same = [np.array(Image.open(osp.join(r, path))) for r in (a, b)]
        np.testing.assert_array_equal(*same)
    assert not np.array_equal(
        np.array(Image.open(osp.join(a, rel))),
        np.array(Image.open(osp.join(c, rel))))


def test_classes_option_and_families_differ(tmp_path):
    root = make_voc_aug(str(tmp_path), 4, 2, size=(32, 32), seed=0,
                        classes=[3, 7])
    labels = [
        np.array(Image.open(p)) for p in sorted(
            (tmp_path / 'VOCdevkit' / 'VOC2012' /
             'SegmentationClassAug').glob('*.png'))
    ]
    assert osp.isdir(root)
    assert set(np.unique(np.stack(labels)).tolist()) <= {0, 3, 7, 255}
    # The same class id looks different in each family (transfer is a task).
    voc, city = class_appearance('voc', 19), class_appearance('cityscapes', 19)
    again = class_appearance('voc', 19)  # fixed per family
    assert all((a['color'] == b['color']).all() for a, b in zip(voc, again))
    diff = [np.abs(v['color'] - c['color']).max() for v, c in zip(voc, city)]
    assert np.median(diff) > 30


def test_labels_learnable_from_colour(tmp_path):
    """A nearest-class-mean pixel classifier fit on train beats chance by
    far on val: the appearance carries the label."""
    root = make_voc_aug(str(tmp_path), 40, 20, size=(48, 48), seed=0,
                        classes=[1, 2, 3, 4, 5, 6], num_aug=0)

    def load(split):
        names = open(osp.join(root, 'ImageSets', 'Segmentation',
                              split + '.txt')).read().split()
        imgs = np.stack([
            np.array(Image.open(osp.join(root, 'JPEGImages', n + '.jpg')))
            for n in names
        ]).reshape(-1, 3).astype(np.float64)
        labs = np.stack([
            np.array(Image.open(osp.join(root, 'SegmentationClassAug',
                                         n + '.png'))) for n in names
        ]).reshape(-1)
        keep = labs != 255
        return imgs[keep], labs[keep]

    x, y = load('train')
    classes = np.unique(y)
    means = np.stack([x[y == c].mean(0) for c in classes])
    xv, yv = load('val')
    pred = classes[np.argmin(
        ((xv[:, None, :] - means[None]) ** 2).sum(-1), axis=1)]
    per_class = [(pred[yv == c] == c).mean() for c in classes
                 if (yv == c).any()]
    assert np.mean(per_class) > 0.5  # chance: 1/7
