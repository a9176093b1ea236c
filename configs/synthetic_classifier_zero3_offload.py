# ZeRO-3 with optimizer states and parameters offloaded to CPU memory
# (ZeRO-Infinity's CPU tier). DeepSpeed's CPU Adam does the update; it is
# JIT-compiled on first use (about a minute, cached in ~/.cache/torch_extensions).
_base_ = './synthetic_classifier_zero3.py'

optim_wrapper = dict(optimizer=dict(_delete_=True, type='DeepSpeedCPUAdam', lr=3e-3,
                                    weight_decay=0.01))
ds_config = dict(
    zero_optimization=dict(
        stage=3,
        offload_optimizer=dict(device='cpu', pin_memory=False),
        offload_param=dict(device='cpu', pin_memory=False)),
    bf16=dict(enabled='auto'))
work_dir = 'work_dirs/synthetic_classifier_zero3_offload'
