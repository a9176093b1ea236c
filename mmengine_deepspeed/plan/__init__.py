"""``mmengine-deepspeed plan``: will a config fit, under which ZeRO stage and offload.

The modules are imported where they are used (``plan.planner`` for ``make_plan``):
``plan.saved`` serves the training log's hook, which engine building imports.
"""
