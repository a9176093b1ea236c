"""The one owner of what DeepSpeed touches in a run (``run.py``), reached by hooks and
loops through ``runner.strategy`` (``access.py``)."""
from .access import agreement_of, strategy_of
from .run import RunStrategy

__all__ = ['RunStrategy', 'agreement_of', 'strategy_of']
