# The demo config, for `mmengine-deepspeed train` (the file lives in the package).
_base_ = '../mmengine_deepspeed/demo/gpt_zero3.py'
