"""Configs of the real OpenMMLab libraries with the three lines, on generated data.

Each is a user's config as the README says to write it: the library's own config as
``_base_``, then the three lines, then what any user changes to train on their own
small data set without downloads: the data root and sizes, no pretrained checkpoint
(the machine has no internet), a short schedule, and detectors keeping their low-score
boxes (after 4 iterations every score is below the configs' 0.05, and COCO's metric is
then empty). Nothing else of the model changes.
"""
from __future__ import annotations

THREE_LINES = '''
custom_imports = dict(imports=['mmengine_deepspeed'], allow_failed_imports=False)
runner_type = 'DeepSpeedRunner'
ds_config = dict(zero_optimization=dict(stage=2))
'''

DETECTION_DATA = '''
data_root = '{root}/'
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='Resize', scale=(128, 128), keep_ratio=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(128, 128), keep_ratio=True),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='PackDetInputs',
         meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor')),
]
train_dataloader = dict(batch_size=2, num_workers=0, persistent_workers=False,
                        dataset=dict(data_root=data_root, pipeline=train_pipeline))
val_dataloader = dict(batch_size=1, num_workers=0, persistent_workers=False,
                      dataset=dict(data_root=data_root, pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(ann_file=data_root + 'annotations/instances_val2017.json')
test_evaluator = val_evaluator
train_cfg = dict(max_epochs=2, val_interval=2)
default_hooks = dict(logger=dict(interval=1))
'''


# MMPretrain's self-supervised configs as a CPU user shrinks them: ResNet-18 and smaller
# projection widths, BatchNorm for SyncBN, 32-pixel views of the library's own augmentations
# ({jitter}: BYOL's colour jitter, without hue: mmcv 2.1's adjust_hue overflows a uint8 on
# NumPy 2), and collate_fn named again (a base config read as 'mmpretrain::' gives it a
# _scope_ key that default_collate refuses, MMEngine 0.10.7).
SELF_SUPERVISED = '''
data_root = '{root}'
model = dict(
    backbone=dict(depth=18, norm_cfg=dict(type='BN')),
    neck=dict(in_channels=512, hid_channels=128, out_channels=64),
    head=dict(predictor=dict(in_channels=64, hid_channels=128, out_channels=64)))
view_pipeline = [
    dict(type='RandomResizedCrop', scale=32, interpolation='bicubic', backend='pillow'),
    dict(type='RandomFlip', prob=0.5),{jitter}
    dict(type='RandomGrayscale', prob=0.2, keep_channels=True,
         channel_weights=(0.114, 0.587, 0.2989)),
]
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='MultiView', num_views=[1, 1], transforms=[view_pipeline, view_pipeline]),
    dict(type='PackInputs'),
]
train_dataloader = dict(batch_size=4, num_workers=0, persistent_workers=False,
                        collate_fn=dict(_delete_=True, type='default_collate'), dataset=dict(
    _delete_=True, type='CustomDataset', data_root=data_root, pipeline=train_pipeline))
train_cfg = dict(max_epochs=2)
default_hooks = dict(logger=dict(interval=1), checkpoint=dict(interval=1, max_keep_ckpts=1))
'''

# MMDetection's semi-supervised Soft Teacher as a CPU user shrinks it: ResNet-18, 96-160-pixel
# images, 2 jitters, one labeled and one unlabeled image per batch (the labeled set's images
# read again without their boxes), every pseudo box kept (a 4-iteration teacher scores below
# the config's 0.9), a lower learning rate. Its MeanTeacherHook copies the student into the
# teacher before training and moves the teacher towards it after every iteration.
SOFT_TEACHER = """
data_root = '{root}/'
scale = [(128, 96), (128, 160)]
detector = _base_.detector
detector.backbone = dict(type='ResNet', depth=18, num_stages=4, out_indices=(0, 1, 2, 3),
                         frozen_stages=1, norm_cfg=dict(type='BN', requires_grad=False),
                         norm_eval=True, style='caffe', init_cfg=None)
detector.neck = dict(type='FPN', in_channels=[64, 128, 256, 512], out_channels=256, num_outs=5)
detector.test_cfg.rcnn.score_thr = 0.0
model = dict(detector=detector, semi_train_cfg=dict(
    jitter_times=2, pseudo_label_initial_score_thr=0.0, cls_pseudo_thr=0.0))
packed = ('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor', 'flip',
          'flip_direction', 'homography_matrix')
sup_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='RandomResize', scale=scale, keep_ratio=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='RandAugment', aug_space=_base_.color_space, aug_num=1),
    dict(type='FilterAnnotations', min_gt_bbox_wh=(1e-2, 1e-2)),
    dict(type='MultiBranch', branch_field=_base_.branch_field, sup=dict(type='PackDetInputs')),
]
weak_pipeline = [
    dict(type='RandomResize', scale=scale, keep_ratio=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs', meta_keys=packed),
]
strong_pipeline = [
    dict(type='RandomResize', scale=scale, keep_ratio=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='RandomOrder', transforms=[
        dict(type='RandAugment', aug_space=_base_.color_space, aug_num=1),
        dict(type='RandAugment', aug_space=_base_.geometric, aug_num=1)]),
    dict(type='RandomErasing', n_patches=(1, 5), ratio=(0, 0.2)),
    dict(type='FilterAnnotations', min_gt_bbox_wh=(1e-2, 1e-2)),
    dict(type='PackDetInputs', meta_keys=packed),
]
unsup_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadEmptyAnnotations'),
    dict(type='MultiBranch', branch_field=_base_.branch_field,
         unsup_teacher=weak_pipeline, unsup_student=strong_pipeline),
]
train_images = dict(data_root=data_root, ann_file='annotations/instances_train2017.json',
                    data_prefix=dict(img='train2017/'))
train_dataloader = dict(
    batch_size=2, num_workers=0, persistent_workers=False,
    sampler=dict(batch_size=2, source_ratio=[1, 1]),
    dataset=dict(datasets=[
        dict(type='CocoDataset', filter_cfg=dict(filter_empty_gt=True, min_size=8),
             pipeline=sup_pipeline, **train_images),
        dict(type='CocoDataset', filter_cfg=dict(filter_empty_gt=False),
             pipeline=unsup_pipeline, **train_images)]))
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(128, 128), keep_ratio=True),
    dict(type='PackDetInputs',
         meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor')),
]
val_dataloader = dict(batch_size=1, num_workers=0, persistent_workers=False,
                      dataset=dict(data_root=data_root, pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(ann_file=data_root + 'annotations/instances_val2017.json')
test_evaluator = val_evaluator
train_cfg = dict(max_iters=4, val_interval=4)
optim_wrapper = dict(optimizer=dict(lr=0.001))
param_scheduler = [dict(type='LinearLR', start_factor=0.001, by_epoch=False, begin=0, end=2)]
default_hooks = dict(logger=dict(interval=1), checkpoint=dict(interval=4))
"""

CONFIGS = {
    # MMDetection, one-stage: RetinaNet R-18 FPN (anchors built with torch.Tensor(numpy))
    'retinanet': ('mmdet', "_base_ = 'mmdet::retinanet/retinanet_r18_fpn_1xb8-1x_coco.py'"
                  + THREE_LINES + DETECTION_DATA + '''
model = dict(backbone=dict(init_cfg=None), test_cfg=dict(score_thr=0.0))
''', 'coco/bbox_mAP'),
    # MMDetection, two-stage: Faster R-CNN FPN (RPN, RoIAlign from mmcv.ops), R-18 backbone
    'faster_rcnn': ('mmdet', "_base_ = 'mmdet::faster_rcnn/faster-rcnn_r50_fpn_1x_coco.py'"
                    + THREE_LINES + DETECTION_DATA + '''
model = dict(backbone=dict(depth=18, init_cfg=None),
             neck=dict(in_channels=[64, 128, 256, 512]),
             test_cfg=dict(rcnn=dict(score_thr=0.0)))
''', 'coco/bbox_mAP'),
    # MMDetection, semi-supervised: Soft Teacher (Faster R-CNN student and teacher, the
    # teacher updated by MeanTeacherHook from outside the model's step)
    'soft_teacher': ('mmdet', "_base_ = 'mmdet::soft_teacher/"
                     "soft-teacher_faster-rcnn_r50-caffe_fpn_180k_semi-0.1-coco.py'"
                     + THREE_LINES + SOFT_TEACHER, 'teacher/coco/bbox_mAP'),
    # MMSegmentation: SegFormer MiT-b0 (drop-path rates from torch.linspace(...).item())
    'segformer': ('mmseg', "_base_ = 'mmseg::segformer/"
                  "segformer_mit-b0_8xb2-160k_ade20k-512x512.py'" + THREE_LINES + '''
data_root = '{root}'
crop_size = (64, 64)
model = dict(data_preprocessor=dict(size=crop_size), backbone=dict(init_cfg=None))
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='RandomResize', scale=(128, 64), ratio_range=(0.5, 2.0), keep_ratio=True),
    dict(type='RandomCrop', crop_size=crop_size, cat_max_ratio=0.75),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PhotoMetricDistortion'),
    dict(type='PackSegInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(128, 64), keep_ratio=True),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='PackSegInputs'),
]
train_dataloader = dict(batch_size=2, num_workers=0, persistent_workers=False,
                        dataset=dict(data_root=data_root, pipeline=train_pipeline))
val_dataloader = dict(batch_size=1, num_workers=0, persistent_workers=False,
                      dataset=dict(data_root=data_root, pipeline=test_pipeline))
test_dataloader = val_dataloader
train_cfg = dict(max_iters=4, val_interval=4)
default_hooks = dict(logger=dict(interval=1), checkpoint=dict(interval=4))
''', 'mIoU'),
    # MMPretrain: ResNet-18 (CIFAR stem), on an image folder instead of CIFAR-10's files
    'resnet_cifar': ('mmpretrain', "_base_ = 'mmpretrain::resnet/resnet18_8xb16_cifar10.py'"
                     + THREE_LINES + '''
data_root = '{root}'
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='RandomCrop', crop_size=32, padding=4),
    dict(type='RandomFlip', prob=0.5, direction='horizontal'),
    dict(type='PackInputs'),
]
test_pipeline = [dict(type='LoadImageFromFile'), dict(type='PackInputs')]
train_dataloader = dict(batch_size=4, num_workers=0, persistent_workers=False, dataset=dict(
    _delete_=True, type='CustomDataset', data_root=data_root, pipeline=train_pipeline))
val_dataloader = dict(batch_size=4, num_workers=0, persistent_workers=False, dataset=dict(
    _delete_=True, type='CustomDataset', data_root=data_root, pipeline=test_pipeline))
test_dataloader = val_dataloader
train_cfg = dict(max_epochs=2, val_interval=2)
default_hooks = dict(logger=dict(interval=1))
''', 'accuracy/top1'),
    # MMPretrain: BYOL, self-supervised: its loss updates an EMA target network (CosineEMA)
    # in the step, and it steps MMPretrain's LARS, one param group per parameter.
    'byol': ('mmpretrain', "_base_ = 'mmpretrain::byol/byol_resnet50_16xb256-coslr-200e_in1k.py'"
             + THREE_LINES + SELF_SUPERVISED.replace('{jitter}', '''
    dict(type='RandomApply', prob=0.8, transforms=[dict(
        type='ColorJitter', brightness=0.4, contrast=0.4, saturation=0.2, hue=0.0)]),'''),
             None),
    # MMPretrain: MoCo v3, the same pattern as BYOL (a CosineEMA momentum encoder updated in
    # its loss, LARS) with a contrastive loss over the ranks' gathered keys. OptimWrapper
    # for its AmpOptimWrapper (fp16 autocast needs CUDA).
    'mocov3': ('mmpretrain', "_base_ = 'mmpretrain::mocov3/"
               "mocov3_resnet50_8xb512-amp-coslr-100e_in1k.py'" + THREE_LINES + '''
optim_wrapper = dict(type='OptimWrapper', _delete_=True,
                     optimizer=dict(type='LARS', lr=9.6, weight_decay=1e-6, momentum=0.9),
                     paramwise_cfg=dict(custom_keys={
                         'bn': dict(decay_mult=0, lars_exclude=True),
                         'bias': dict(decay_mult=0, lars_exclude=True),
                         'downsample.1': dict(decay_mult=0, lars_exclude=True)}))'''
               + SELF_SUPERVISED.replace('{jitter}', ''), None),
    # MMagic: DCGAN (a generator and a discriminator: one engine each), through MMagic's
    # tools/train.py, which calls Runner.from_cfg(cfg) whatever runner_type says. No
    # validation: its metrics (MS-SSIM, SWD) sample 10,000 images.
    'dcgan': ('mmagic', "_base_ = 'mmagic::dcgan/dcgan_1xb128-300kiters_celeba-cropped-64.py'"
              + THREE_LINES + '''
data_root = '{root}'
train_dataloader = dict(batch_size=2, num_workers=0, persistent_workers=False,
                        dataset=dict(data_root=data_root, recursive=True))
val_dataloader = None
val_cfg = None
val_evaluator = None
test_dataloader = None
test_cfg = None
test_evaluator = None
train_cfg = dict(max_iters=4)
default_hooks = dict(logger=dict(interval=1), checkpoint=dict(interval=4))
custom_hooks = []
''', None),
}
