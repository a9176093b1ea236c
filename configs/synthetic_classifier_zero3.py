# A plain MMEngine config (model, data, schedule) ...
custom_imports = dict(imports=['examples.synthetic_classifier'], allow_failed_imports=False)

model = dict(type='SmallConvNet', num_classes=10,
             data_preprocessor=dict(type='BaseDataPreprocessor'))
train_dataloader = dict(
    batch_size=16,
    num_workers=0,
    dataset=dict(type='SyntheticImages', size=512, seed=0),
    sampler=dict(type='DefaultSampler', shuffle=True),
    collate_fn=dict(type='default_collate'))
val_dataloader = dict(
    batch_size=32,
    num_workers=0,
    dataset=dict(type='SyntheticImages', size=256, seed=1),
    sampler=dict(type='DefaultSampler', shuffle=False),
    collate_fn=dict(type='default_collate'))
val_evaluator = dict(type='SyntheticAccuracy')
train_cfg = dict(by_epoch=True, max_epochs=4, val_interval=2)
val_cfg = dict()
optim_wrapper = dict(optimizer=dict(type='AdamW', lr=3e-3, weight_decay=0.01),
                     clip_grad=dict(max_norm=5.0))
param_scheduler = [
    dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=20),
    dict(type='CosineAnnealingLR', by_epoch=True, begin=0, T_max=4),
]
default_hooks = dict(logger=dict(type='LoggerHook', interval=8), checkpoint=None)
randomness = dict(seed=0)
work_dir = 'work_dirs/synthetic_classifier_zero3'

# ... plus the three lines that train it with DeepSpeed ZeRO-3 (bf16 where the
# hardware computes it natively, fp32 elsewhere).
custom_imports = dict(imports=['examples.synthetic_classifier', 'mmengine_deepspeed'],
                      allow_failed_imports=False)
runner_type = 'DeepSpeedRunner'
ds_config = dict(zero_optimization=dict(stage=3), bf16=dict(enabled='auto'))
