"""Tiny synthetic datasets in the on-disk layouts of VOC aug, Cityscapes and
ADE20K.

Each class has its own colour and texture, drawn per dataset family, so
labels are learnable from appearance and moving between families is a real
transfer task. A seeded generator makes label maps byte-identical for the
same arguments. Only numpy and Pillow are used.
"""
import os
import os.path as osp
import zlib
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from PIL import Image

Size = Tuple[int, int]

IGNORE_INDEX = 255

CITYSCAPES_TRAIN_CITIES = ('aachen', 'bochum', 'bremen')
CITYSCAPES_VAL_CITIES = ('frankfurt', 'lindau')

_TEXTURES = ('stripes', 'checker', 'dots', 'blotches', 'rings')


def voc_palette() -> List[int]:
    """The 256-entry Pascal VOC colour map, flattened for ``putpalette``."""
    palette = []
    for idx in range(256):
        r = g = b = 0
        c = idx
        for j in range(8):
            r |= ((c >> 0) & 1) << (7 - j)
            g |= ((c >> 1) & 1) << (7 - j)
            b |= ((c >> 2) & 1) << (7 - j)
            c >>= 3
        palette += [r, g, b]
    return palette


def _family_seed(family: str) -> int:
    return zlib.crc32(family.encode('utf-8'))


def class_appearance(family: str, num_classes: int) -> List[Dict]:
    """Appearance table of one family: one dict per class id.

    It depends only on ``family``, so splits and seeds share appearances.
    """
    rng = np.random.default_rng(_family_seed(family))
    table = []
    # Spread hues so that classes are distinguishable by colour, then shuffle
    # the assignment per family (the family shift).
    hues = (np.arange(num_classes) + rng.uniform()) / num_classes
    rng.shuffle(hues)
    for cls in range(num_classes):
        h = hues[cls]
        sat = rng.uniform(0.5, 1.0)
        val = rng.uniform(0.45, 1.0)
        color = _hsv_to_rgb(h, sat, val)
        color2 = _hsv_to_rgb((h + rng.uniform(0.15, 0.5)) % 1.0,
                             rng.uniform(0.2, 1.0), rng.uniform(0.1, 0.6))
        table.append(
            dict(
                color=color,
                color2=color2,
                texture=_TEXTURES[int(rng.integers(len(_TEXTURES)))],
                freq=float(rng.uniform(0.15, 0.6)),
                angle=float(rng.uniform(0, np.pi))))
    return table


def _hsv_to_rgb(h: float, s: float, v: float) -> np.ndarray:
    i = int(h * 6) % 6
    f = h * 6 - int(h * 6)
    p, q, t = v * (1 - s), v * (1 - f * s), v * (1 - (1 - f) * s)
    rgb = [(v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v),
           (v, p, q)][i]
    return np.array(rgb, dtype=np.float32) * 255.0


def _pattern(kind: str, freq: float, angle: float, yy: np.ndarray,
             xx: np.ndarray, phase: float) -> np.ndarray:
    """A texture in [0, 1] on the pixel grid."""
    u = np.cos(angle) * xx + np.sin(angle) * yy
    v = -np.sin(angle) * xx + np.cos(angle) * yy
    if kind == 'stripes':
        return 0.5 + 0.5 * np.sin(freq * u + phase)
    if kind == 'checker':
        return ((np.floor(freq * u / np.pi + phase) +
                 np.floor(freq * v / np.pi)) % 2).astype(np.float32)
    if kind == 'dots':
        return ((np.sin(freq * u + phase) * np.sin(freq * v)) >
                0.5).astype(np.float32)
    if kind == 'rings':
        return 0.5 + 0.5 * np.sin(freq * np.sqrt(u * u + v * v) + phase)
    # blotches: a sum of two incommensurate waves
    return 0.5 + 0.25 * (np.sin(freq * u + phase) +
                         np.sin(0.7 * freq * v + 2 * phase))


def _render(app: Dict, yy, xx, rng: np.random.Generator) -> np.ndarray:
    pat = _pattern(app['texture'], app['freq'], app['angle'], yy, xx,
                   float(rng.uniform(0, 2 * np.pi)))[..., None]
    # Keep texture contrast moderate so colour stays the dominant cue.
    img = app['color'] * (1 - 0.6 * pat) + app['color2'] * 0.6 * pat
    return img


def _shape_mask(rng: np.random.Generator, yy: np.ndarray, xx: np.ndarray,
                h: int, w: int) -> np.ndarray:
    scale = rng.uniform(0.12, 0.4) * min(h, w)
    cy, cx = rng.uniform(0.1, 0.9) * h, rng.uniform(0.1, 0.9) * w
    kind = int(rng.integers(3))
    if kind == 0:  # ellipse, rotated
        a, b = scale, scale * rng.uniform(0.4, 1.0)
        t = rng.uniform(0, np.pi)
        u = np.cos(t) * (xx - cx) + np.sin(t) * (yy - cy)
        v = -np.sin(t) * (xx - cx) + np.cos(t) * (yy - cy)
        return (u / a)**2 + (v / b)**2 <= 1.0
    if kind == 1:  # axis-aligned rectangle
        hh, hw = scale * rng.uniform(0.5, 1.0), scale * rng.uniform(0.5, 1.0)
        return (np.abs(yy - cy) <= hh) & (np.abs(xx - cx) <= hw)
    # triangle: three random vertices around the centre
    ang = rng.uniform(0, 2 * np.pi) + np.array([0, 2.1, 4.2])
    ang += rng.uniform(-0.3, 0.3, size=3)
    py, px = cy + scale * np.sin(ang), cx + scale * np.cos(ang)
    inside = np.ones_like(yy, dtype=bool)
    sign = None
    for i in range(3):
        j = (i + 1) % 3
        cross = (px[j] - px[i]) * (yy - py[i]) - (py[j] - py[i]) * (xx - px[i])
        s = cross >= 0
        if sign is None:
            sign = np.sign((px[1] - px[0]) * (py[2] - py[0]) -
                           (py[1] - py[0]) * (px[2] - px[0]))
        inside &= s if sign >= 0 else ~s
    return inside


def _border(label: np.ndarray, width: int) -> np.ndarray:
    """Pixels within ``width`` of a change of label (4-neighbourhood)."""
    edge = np.zeros(label.shape, dtype=bool)
    dy = label[1:, :] != label[:-1, :]
    dx = label[:, 1:] != label[:, :-1]
    edge[1:, :] |= dy
    edge[:-1, :] |= dy
    edge[:, 1:] |= dx
    edge[:, :-1] |= dx
    grown = edge.copy()
    for _ in range(max(width - 1, 0)):
        g = grown.copy()
        g[1:, :] |= grown[:-1, :]
        g[:-1, :] |= grown[1:, :]
        g[:, 1:] |= grown[:, :-1]
        g[:, :-1] |= grown[:, 1:]
        grown = g
    return grown


def render_sample(rng: np.random.Generator,
                  size: Size,
                  appearance: List[Dict],
                  background: Sequence[int],
                  objects: Sequence[int],
                  num_objects: Tuple[int, int] = (1, 4),
                  border: int = 0,
                  bg_appearance: Optional[Dict] = None
                  ) -> Tuple[np.ndarray, np.ndarray]:
    """Draw one (image, label) pair.

    Args:
        rng: the random generator (consumed deterministically).
        size: ``(H, W)``.
        appearance: class appearance table, indexed by label id.
        background: label ids the background may take.
        objects: label ids the objects may take.
        num_objects: inclusive range of the number of shapes.
        border: width of the ``255`` band at label boundaries; 0 for none.
        bg_appearance: background appearance when it is no class (ADE20K).

    Returns:
        ``uint8`` RGB image ``(H, W, 3)`` and ``uint8`` label ``(H, W)``.
    """
    h, w = size
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    bg_cls = int(rng.choice(np.asarray(background)))
    label = np.full((h, w), bg_cls, dtype=np.uint8)
    app = bg_appearance if bg_appearance is not None else appearance[bg_cls]
    img = _render(app, yy, xx, rng)
    # A smooth illumination gradient on the background.
    gy, gx = rng.uniform(-0.3, 0.3, size=2)
    img = img * (1 + gy * (yy / h - 0.5) + gx * (xx / w - 0.5))[..., None]
    n = int(rng.integers(num_objects[0], num_objects[1] + 1))
    for _ in range(n):
        cls = int(rng.choice(np.asarray(objects)))
        mask = _shape_mask(rng, yy, xx, h, w)
        if not mask.any():
            continue
        obj = _render(appearance[cls], yy, xx, rng)
        obj = obj * rng.uniform(0.85, 1.15)  # per-object brightness
        img[mask] = obj[mask]
        label[mask] = cls
    img = img + rng.normal(0, 6.0, size=img.shape)
    img = np.clip(img, 0, 255).astype(np.uint8)
    if border > 0:
        label[_border(label, border)] = IGNORE_INDEX
    return img, label


def _makedirs(*paths: str) -> None:
    for p in paths:
        os.makedirs(p, exist_ok=True)


def _save_rgb(img: np.ndarray, path: str) -> None:
    if path.endswith('.jpg'):
        Image.fromarray(img).save(path, quality=95)
    else:
        Image.fromarray(img).save(path)


def make_voc_aug(root: str,
                 num_train: int,
                 num_val: int,
                 size: Size = (128, 128),
                 seed: int = 0,
                 classes: Optional[Sequence[int]] = None,
                 num_aug: Optional[int] = None) -> str:
    """Write a Pascal VOC 2012 + SBD-aug style dataset under ``root``.

    Layout as mmseg's ``pascal_voc12_aug.py`` expects: ``train.txt`` and
    ``val.txt`` with palette labels in SegmentationClass, ``aug.txt`` with
    grayscale labels in SegmentationClassAug; 255 marks object borders.

    Args:
        root: output root (``VOCdevkit`` is created inside).
        num_train, num_val: images in ``train.txt`` / ``val.txt``.
        size: ``(H, W)`` of every image.
        seed: RNG seed.
        classes: object class ids (subset of 1..20); ``None`` for all.
        num_aug: images in ``aug.txt`` (defaults to ``num_train``).

    Returns:
        The ``VOC2012`` directory (the config's ``data_root``).
    """
    objects = list(range(1, 21)) if classes is None else [
        int(c) for c in classes
    ]
    assert all(1 <= c <= 20 for c in objects), 'VOC object ids are 1..20'
    num_aug = num_train if num_aug is None else num_aug
    data_root = osp.join(root, 'VOCdevkit', 'VOC2012')
    img_dir = osp.join(data_root, 'JPEGImages')
    cls_dir = osp.join(data_root, 'SegmentationClass')
    aug_dir = osp.join(data_root, 'SegmentationClassAug')
    set_dir = osp.join(data_root, 'ImageSets', 'Segmentation')
    _makedirs(img_dir, cls_dir, aug_dir, set_dir)
    appearance = class_appearance('voc', 21)
    rng = np.random.default_rng(seed)
    palette = voc_palette()
    splits = dict(
        train=[f'2007_{i:06d}' for i in range(num_train)],
        val=[f'2007_{num_train + i:06d}' for i in range(num_val)],
        aug=[f'2008_{i:06d}' for i in range(num_aug)])
    for split in ('train', 'val', 'aug'):
        for name in splits[split]:
            img, label = render_sample(
                rng, size, appearance, background=[0], objects=objects,
                num_objects=(1, 3), border=2)
            _save_rgb(img, osp.join(img_dir, name + '.jpg'))
            Image.fromarray(label, mode='L').save(
                osp.join(aug_dir, name + '.png'))
            if split != 'aug':
                pimg = Image.fromarray(label, mode='P')
                pimg.putpalette(palette)
                pimg.save(osp.join(cls_dir, name + '.png'))
        with open(osp.join(set_dir, split + '.txt'), 'w') as f:
            f.write(''.join(n + '\n' for n in splits[split]))
    return data_root


def make_cityscapes(root: str,
                    num_train: int,
                    num_val: int,
                    size: Size = (128, 256),
                    seed: int = 0,
                    classes: Optional[Sequence[int]] = None) -> str:
    """Write a Cityscapes style dataset (train ids 0..18) under ``root``.

    Returns:
        ``root`` (the config's ``data_root``).
    """
    objects = list(range(19)) if classes is None else [int(c) for c in classes]
    assert all(0 <= c <= 18 for c in objects), 'train ids are 0..18'
    appearance = class_appearance('cityscapes', 19)
    rng = np.random.default_rng(seed)
    for split, n, cities in (('train', num_train, CITYSCAPES_TRAIN_CITIES),
                             ('val', num_val, CITYSCAPES_VAL_CITIES)):
        for i in range(n):
            city = cities[i % len(cities)]
            stem = f'{city}_{i:06d}_000019'
            img_dir = osp.join(root, 'leftImg8bit', split, city)
            ann_dir = osp.join(root, 'gtFine', split, city)
            _makedirs(img_dir, ann_dir)
            img, label = render_sample(
                rng, size, appearance, background=[0, 1, 2, 8, 9, 10],
                objects=objects, num_objects=(2, 5), border=1)
            _save_rgb(img, osp.join(img_dir, stem + '_leftImg8bit.png'))
            Image.fromarray(label, mode='L').save(
                osp.join(ann_dir, stem + '_gtFine_labelTrainIds.png'))
    return root


def make_ade20k(root: str,
                num_train: int,
                num_val: int,
                size: Size = (128, 128),
                seed: int = 0,
                classes: Optional[Sequence[int]] = None) -> str:
    """Write an ADE20K (ADEChallengeData2016) style dataset under ``root``.

    Label 0 is "other" (ignored through ``reduce_zero_label=True``).

    Returns:
        The ``ADEChallengeData2016`` directory (the config's ``data_root``).
    """
    objects = list(range(1, 151)) if classes is None else [
        int(c) for c in classes
    ]
    assert all(1 <= c <= 150 for c in objects), 'ADE20K ids are 1..150'
    data_root = osp.join(root, 'ADEChallengeData2016')
    appearance = class_appearance('ade20k', 151)
    other = dict(
        color=np.array([120., 120., 120.], dtype=np.float32),
        color2=np.array([60., 60., 60.], dtype=np.float32),
        texture='blotches', freq=0.1, angle=0.3)
    rng = np.random.default_rng(seed)
    for split, prefix, n in (('training', 'ADE_train', num_train),
                             ('validation', 'ADE_val', num_val)):
        img_dir = osp.join(data_root, 'images', split)
        ann_dir = osp.join(data_root, 'annotations', split)
        _makedirs(img_dir, ann_dir)
        for i in range(n):
            stem = f'{prefix}_{i + 1:08d}'
            img, label = render_sample(
                rng, size, appearance, background=[0], objects=objects,
                num_objects=(2, 5), border=0, bg_appearance=other)
            _save_rgb(img, osp.join(img_dir, stem + '.jpg'))
            Image.fromarray(label, mode='L').save(
                osp.join(ann_dir, stem + '.png'))
    return data_root


MAKERS = dict(voc=make_voc_aug, cityscapes=make_cityscapes, ade20k=make_ade20k)
