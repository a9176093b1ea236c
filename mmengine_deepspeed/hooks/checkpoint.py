"""CheckpointHook that removes old checkpoints only after the new one is complete,
and publishes (``published_keys``) from a checkpoint directory.

MMEngine's ``CheckpointHook`` deletes the oldest checkpoint (``max_keep_ckpts``)
*before* saving the next one; with ``max_keep_ckpts=1`` a crash during the
save leaves nothing to resume from. This subclass keeps MMEngine's
bookkeeping (``keep_ckpt_ids`` in the message hub, the file names, save_best,
save_last) and moves the deletion after the save. DeepSpeedRunner uses it in
place of ``CheckpointHook`` automatically.
"""
from __future__ import annotations

import os
import shutil
from typing import Any, Optional

from mmengine.dist import is_main_process
from mmengine.hooks import CheckpointHook
from mmengine.registry import HOOKS
from typing_extensions import override

from ..checkpoint.export import publish_checkpoint
from ..strategy import strategy_of


@HOOKS.register_module()
class DeepSpeedCheckpointHook(CheckpointHook):
    """:class:`mmengine.hooks.CheckpointHook`, crash-safe with ``max_keep_ckpts``."""

    max_keep_ckpts: int

    @override
    def _save_checkpoint_with_step(self, runner: Any, step: int, meta: dict) -> None:
        # Overrides a private method of CheckpointHook (MMEngine 0.10): it is
        # the one place the removal happens; tests/unit pin its behaviour.
        keep = self.max_keep_ckpts
        outdated: Optional[int] = None
        if keep > 0 and not (self.keep_ckpt_ids and self.keep_ckpt_ids[-1] == step):
            if len(self.keep_ckpt_ids) == keep:
                outdated = self.keep_ckpt_ids.popleft()
            self.keep_ckpt_ids.append(step)
            runner.message_hub.update_info('keep_ckpt_ids', list(self.keep_ckpt_ids))
        self.max_keep_ckpts = -1  # the parent must neither delete nor count
        try:
            super()._save_checkpoint_with_step(runner, step, meta)
        finally:
            self.max_keep_ckpts = keep
        if outdated is not None and is_main_process():
            path = self.file_backend.join_path(self.out_dir, self.filename_tmpl.format(outdated))
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.isfile(path):
                os.remove(path)

    @override
    def _publish_model(self, runner: Any, ckpt_path: str) -> None:
        # Overrides a private method of CheckpointHook (MMEngine 0.10), which
        # reads the checkpoint as one file; ours is a directory.
        if not is_main_process():
            return
        assert self.published_keys is not None
        unsafe = strategy_of(runner, 'DeepSpeedCheckpointHook').allow_unsafe_checkpoints
        out, missing = publish_checkpoint(ckpt_path, self.published_keys, unsafe)
        if missing:
            runner.logger.warning(
                f'published_keys {missing} are not published: DeepSpeed keeps the optimizer '
                f'state partitioned in {ckpt_path}; resume from that directory instead.')
        runner.logger.info(f'The checkpoint ({ckpt_path}) is published to {out}.')
