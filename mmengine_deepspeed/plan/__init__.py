"""``mmengine-deepspeed plan``: will a config fit, under which ZeRO stage and offload."""
from .planner import Plan, Row, make_plan

__all__ = ['Plan', 'Row', 'make_plan']
