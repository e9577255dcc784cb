"""Synthetic datasets in the real on-disk layouts (VOC12Aug, Cityscapes,
ADE20K) for offline tests and the CPU demo. The real mmseg dataset classes
read them unchanged; nothing is registered here."""
from .synthetic import (MAKERS, class_appearance, make_ade20k,
                        make_cityscapes, make_voc_aug, voc_palette)

__all__ = [
    'MAKERS', 'class_appearance', 'make_ade20k', 'make_cityscapes',
    'make_voc_aug', 'voc_palette'
]
