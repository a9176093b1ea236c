"""An epoch-based train loop that resumes in the middle of an epoch.

MMEngine's ``EpochBasedTrainLoop`` restarts an interrupted epoch from its
first batch, so a checkpoint taken by iteration (``CheckpointHook(by_epoch=
False)``) inside an epoch replays data and shifts every later iteration.
This loop skips the batches the checkpointed run had already trained on in
that epoch; the sampler's order is the same (it is seeded by seed and
epoch), so training continues exactly where it stopped. DeepSpeedRunner uses
it wherever a config asks for ``EpochBasedTrainLoop``.
"""
from __future__ import annotations

from mmengine.registry import LOOPS
from mmengine.runner import EpochBasedTrainLoop


@LOOPS.register_module()
class ResumableEpochBasedTrainLoop(EpochBasedTrainLoop):
    """:class:`mmengine.runner.EpochBasedTrainLoop` that can resume mid-epoch."""

    _skip_batches = 0

    def resume_within_epoch(self) -> int:
        """Arrange to skip the batches of the current epoch already trained on.

        Called after the loop's ``_epoch`` / ``_iter`` were restored.

        Returns:
            int: The number of batches that will be skipped.
        """
        self._skip_batches = self._iter - self._epoch * len(self.dataloader)
        return self._skip_batches

    def run_epoch(self) -> None:
        """Iterate one epoch, skipping what a mid-epoch checkpoint already saw."""
        skip, self._skip_batches = self._skip_batches, 0
        if not skip:
            super().run_epoch()
            return
        self.runner.call_hook('before_train_epoch')
        self.runner.model.train()
        for idx, data_batch in enumerate(self.dataloader):
            if idx >= skip:
                self.run_iter(idx, data_batch)
        self.runner.call_hook('after_train_epoch')
        self._epoch += 1
