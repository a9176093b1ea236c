"""The non-finite step as one concept, above the device-side check of each step
(``engine/nonfinite.py``: an update that is not finite is never applied):

* ``failed_steps.py``: the ``nonfinite`` settings, a failed step as every rank saw it, and
  what one rank sees of failed steps (the message hub's observer, no collective);
* ``monitor.py``: every rank's view gathered (on failures only) and reported;
* ``hook.py``: ``NonFiniteHook``, which agrees, then applies the policy: go on, stop, or
  roll back (``RunStrategy.roll_back``: the checkpoint restored, the samples left out).
"""
