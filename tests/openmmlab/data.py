"""Small generated data sets in the layouts OpenMMLab's dataset classes read.

COCO detection (``annotations/instances_{train,val}2017.json`` with images whose
boxes are drawn in), ADE20K segmentation (``images/`` and ``annotations/`` PNG label
maps of the drawn shapes) and an image-folder classification set (one folder per
class). Each image shows its labels, so a few iterations move the losses.
"""
from __future__ import annotations

import json
import os
import os.path as osp

import cv2
import numpy as np

COLOURS = [(220, 40, 40), (40, 220, 40), (40, 40, 220)]


def _blank(rng: np.random.Generator, size: int) -> np.ndarray:
    return rng.integers(0, 60, size=(size, size, 3), dtype=np.uint8)


def coco_detection(root: str, train: int = 8, val: int = 4, size: int = 128,
                   seed: int = 0) -> str:
    """A COCO-format detection set under ``root``; returns ``root``.

    Every COCO class is listed (a detector predicts any of them, and COCO's metric maps
    each prediction to a listed category); the boxes are of the first three.
    """
    from mmdet.datasets import CocoDataset

    categories = list(enumerate(CocoDataset.METAINFO['classes'], start=1))
    rng = np.random.default_rng(seed)
    os.makedirs(osp.join(root, 'annotations'), exist_ok=True)
    for split, count in (('train2017', train), ('val2017', val)):
        os.makedirs(osp.join(root, split), exist_ok=True)
        images, annotations = [], []
        for index in range(count):
            image = _blank(rng, size)
            image_id = index + 1
            for _ in range(int(rng.integers(1, 4))):
                label = int(rng.integers(len(COLOURS)))
                w, h = (int(v) for v in rng.integers(24, size // 2, size=2))
                x, y = int(rng.integers(0, size - w)), int(rng.integers(0, size - h))
                cv2.rectangle(image, (x, y), (x + w - 1, y + h - 1), COLOURS[label], -1)
                annotations.append(dict(
                    id=len(annotations) + 1, image_id=image_id,
                    category_id=categories[label][0], bbox=[x, y, w, h], area=w * h,
                    iscrowd=0, segmentation=[[x, y, x + w, y, x + w, y + h, x, y + h]]))
            name = f'{image_id:012d}.jpg'
            cv2.imwrite(osp.join(root, split, name), image)
            images.append(dict(id=image_id, file_name=name, width=size, height=size))
        with open(osp.join(root, 'annotations', f'instances_{split}.json'), 'w') as f:
            json.dump(dict(images=images, annotations=annotations, categories=[
                dict(id=i, name=n, supercategory='none') for i, n in categories]), f)
    return root


def ade20k_segmentation(root: str, train: int = 8, val: int = 4, size: int = 64,
                        seed: int = 0) -> str:
    """An ADE20K-layout segmentation set under ``root`` (labels 1-3, 0 = ignored)."""
    rng = np.random.default_rng(seed)
    for split, count in (('training', train), ('validation', val)):
        os.makedirs(osp.join(root, 'images', split), exist_ok=True)
        os.makedirs(osp.join(root, 'annotations', split), exist_ok=True)
        for index in range(count):
            image = _blank(rng, size)
            labels = np.ones((size, size), dtype=np.uint8)  # background: class 1
            for label in (2, 3):
                w, h = (int(v) for v in rng.integers(12, size // 2, size=2))
                x, y = int(rng.integers(0, size - w)), int(rng.integers(0, size - h))
                image[y:y + h, x:x + w] = COLOURS[label - 1]
                labels[y:y + h, x:x + w] = label
            name = f'ADE_{split}_{index:08d}'
            cv2.imwrite(osp.join(root, 'images', split, f'{name}.jpg'), image)
            cv2.imwrite(osp.join(root, 'annotations', split, f'{name}.png'), labels)
    return root


def image_folders(root: str, per_class: int = 8, classes: int = 3, size: int = 32,
                  seed: int = 0) -> str:
    """Class-per-folder images under ``root`` (``class_k/xxx.png``)."""
    rng = np.random.default_rng(seed)
    for label in range(classes):
        folder = osp.join(root, f'class_{label}')
        os.makedirs(folder, exist_ok=True)
        for index in range(per_class):
            image = _blank(rng, size)
            image[size // 4: 3 * size // 4, size // 4: 3 * size // 4] = COLOURS[label]
            cv2.imwrite(osp.join(folder, f'{index:04d}.png'), image)
    return root
