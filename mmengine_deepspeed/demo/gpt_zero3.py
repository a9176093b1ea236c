# The demo: a tiny byte-level GPT on the Python standard library's source,
# DeepSpeed ZeRO-3, in bf16 where the hardware computes it natively (fp32
# elsewhere: "auto"). `mmengine-deepspeed demo` runs it; so does
# `mmengine-deepspeed train` with this file (configs/demo_gpt_zero3.py).
custom_imports = dict(imports=['mmengine_deepspeed', 'mmengine_deepspeed.demo'],
                      allow_failed_imports=False)
runner_type = 'DeepSpeedRunner'
ds_config = dict(zero_optimization=dict(stage=3), bf16=dict(enabled='auto'))

block_size = 64
model = dict(type='TinyGPT', block_size=block_size, width=128, depth=4, heads=4,
             data_preprocessor=dict(type='BaseDataPreprocessor'))
train_dataloader = dict(
    batch_size=16,
    num_workers=0,
    dataset=dict(type='StdlibText', part='train', block_size=block_size, stride=37),
    sampler=dict(type='InfiniteSampler', shuffle=True),
    collate_fn=dict(type='default_collate'))
val_dataloader = dict(
    batch_size=64,
    num_workers=0,
    dataset=dict(type='StdlibText', part='val', block_size=block_size, stride=256),
    sampler=dict(type='DefaultSampler', shuffle=False),
    collate_fn=dict(type='default_collate'))
val_evaluator = dict(type='ValLoss')
max_iters = 300
train_cfg = dict(by_epoch=False, max_iters=max_iters, val_interval=100)
val_cfg = dict()
optim_wrapper = dict(optimizer=dict(type='AdamW', lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1),
                     clip_grad=dict(max_norm=1.0))
param_scheduler = [
    dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=30),
    dict(type='CosineAnnealingLR', by_epoch=False, begin=30, end=max_iters, eta_min=3e-4),
]
default_hooks = dict(logger=dict(type='LoggerHook', interval=25, log_metric_by_epoch=False),
                     checkpoint=dict(type='CheckpointHook', interval=100, by_epoch=False,
                                     max_keep_ckpts=1))
log_processor = dict(by_epoch=False)
randomness = dict(seed=0)
