"""Checkpoint files in one process: validation errors, safe loading, state round trips."""
from __future__ import annotations

import json
import os
import os.path as osp
import random
from typing import Any

import numpy as np
import pytest
import torch
from mmengine.config import Config
from mmengine.logging import MessageHub
from mmengine.runner import Runner

from mmengine_deepspeed.checkpoint.layout import (
    CLIENT_FILE,
    DS_TAG,
    FORMAT_VERSION,
    LAST_CHECKPOINT,
    MARKER_FILE,
    META_FILE,
    RANK_FILE,
    CheckpointError,
    check_checkpoint,
    find_latest_complete,
)
from mmengine_deepspeed.checkpoint.load_weights import load_weights_into, read_weights
from mmengine_deepspeed.checkpoint.reshard import Sharding, check_reshardable, needs_universal
from mmengine_deepspeed.checkpoint.safe_load import check_pickles, safe_load
from mmengine_deepspeed.checkpoint.state import (
    hub_state,
    load_hub_state,
    load_rank_state,
    rank_state,
)
from mmengine_deepspeed.cli import describe
from tests.helpers import ToyModel, toy_config

SHARD = 'mp_rank_00_model_states.pt'


def make_checkpoint(path: str, iteration: int = 4, complete: bool = True, world_size: int = 1,
                    zero_stage: int = 0, optimizer_state: bool = True) -> str:
    """A structurally valid checkpoint directory (tiny files; by default one rank, ZeRO-0)."""
    os.makedirs(osp.join(path, DS_TAG))
    torch.save({'module': {}}, osp.join(path, DS_TAG, SHARD))
    torch.save({'meta': {}}, osp.join(path, CLIENT_FILE))
    for rank in range(world_size):
        torch.save({}, osp.join(path, RANK_FILE.format(rank=rank)))
    meta = dict(format_version=FORMAT_VERSION, shards=[osp.join(DS_TAG, SHARD)],
                world_size=world_size, zero_stage=zero_stage, optimizer_state=optimizer_state,
                precision='fp32', epoch=0, iter=iteration)
    with open(osp.join(path, META_FILE), 'w') as f:
        json.dump(meta, f)
    if complete:
        open(osp.join(path, MARKER_FILE), 'w').close()
    return path


def test_format_1_checkpoints_are_still_read(tmp_path: Any) -> None:
    """Format 1 (one engine) listed its shards inside deepspeed/; they are still checked."""
    path = make_checkpoint(str(tmp_path / 'ck'))
    with open(osp.join(path, META_FILE)) as f:
        meta = json.load(f)
    with open(osp.join(path, META_FILE), 'w') as f:
        json.dump(dict(meta, format_version=1, shards=[SHARD]), f)
    assert check_checkpoint(path)['format_version'] == 1
    os.remove(osp.join(path, DS_TAG, SHARD))
    with pytest.raises(CheckpointError, match=SHARD):
        check_checkpoint(path)


# --- clear errors -----------------------------------------------------------------

def test_valid_checkpoint_passes(tmp_path: Any) -> None:
    assert check_checkpoint(make_checkpoint(str(tmp_path / 'ck')))['iter'] == 4


def test_file_instead_of_directory(tmp_path: Any) -> None:
    path = tmp_path / 'epoch_1.pth'
    path.write_bytes(b'x')
    with pytest.raises(CheckpointError, match=r'is a file, but a DeepSpeedRunner checkpoint is '
                                              r'a directory\..*load_from without resume'):
        check_checkpoint(str(path))


def test_missing_directory(tmp_path: Any) -> None:
    with pytest.raises(CheckpointError, match='does not exist'):
        check_checkpoint(str(tmp_path / 'nope'))


def test_missing_marker_names_the_file(tmp_path: Any) -> None:
    path = make_checkpoint(str(tmp_path / 'ck'), complete=False)
    with pytest.raises(CheckpointError, match=f'{MARKER_FILE} is missing.*did not finish'):
        check_checkpoint(path)


def test_missing_shard_names_the_file(tmp_path: Any) -> None:
    path = make_checkpoint(str(tmp_path / 'ck'))
    os.remove(osp.join(path, DS_TAG, SHARD))
    with pytest.raises(CheckpointError, match=f'{SHARD} is missing'):
        check_checkpoint(path)


def test_truncated_shard_names_the_file(tmp_path: Any) -> None:
    path = make_checkpoint(str(tmp_path / 'ck'))
    shard = osp.join(path, DS_TAG, SHARD)
    with open(shard, 'r+b') as f:
        f.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(CheckpointError, match=f'{SHARD} is truncated or corrupt'):
        check_checkpoint(path)


def test_missing_rank_state(tmp_path: Any) -> None:
    path = make_checkpoint(str(tmp_path / 'ck'))
    os.remove(osp.join(path, RANK_FILE.format(rank=0)))
    with pytest.raises(CheckpointError, match=r'rank_state_rank0\.pt is missing'):
        check_checkpoint(path)


def test_other_format_version(tmp_path: Any) -> None:
    path = make_checkpoint(str(tmp_path / 'ck'))
    with open(osp.join(path, META_FILE), 'w') as f:
        json.dump({'format_version': 99}, f)
    with pytest.raises(CheckpointError, match='format 99'):
        check_checkpoint(path)


def test_shape_mismatch_names_the_file(tmp_path: Any) -> None:
    path = str(tmp_path / 'other.pth')
    torch.save({'state_dict': ToyModel(hidden=32).state_dict()}, path)
    with pytest.raises(CheckpointError,
                       match=r'(?s)other\.pth does not fit this model.*size mismatch'):
        load_weights_into(ToyModel(), path, strict=False, revise_keys=[],
                          allow_unsafe=False, logger=_Log())


def test_strict_load_refuses_missing_keys(tmp_path: Any) -> None:
    path = str(tmp_path / 'partial.pth')
    state = ToyModel().state_dict()
    state.pop('fc2.bias')
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=r'fc2\.bias'):
        load_weights_into(ToyModel(), path, strict=True, revise_keys=[],
                          allow_unsafe=False, logger=_Log())
    log = _Log()
    load_weights_into(ToyModel(), path, strict=False, revise_keys=[], allow_unsafe=False,
                      logger=log)
    assert any('fc2.bias' in m for m in log.warnings)


def test_load_from_missing_file(tmp_path: Any) -> None:
    with pytest.raises(CheckpointError, match='does not exist'):
        read_weights(str(tmp_path / 'missing.pth'), allow_unsafe=False)


def test_load_from_non_state_dict(tmp_path: Any) -> None:
    path = str(tmp_path / 'list.pth')
    torch.save([1, 2], path)
    with pytest.raises(CheckpointError, match='holds a list, not a state dict'):
        read_weights(path, allow_unsafe=False)


class _Log:
    def __init__(self) -> None:
        self.warnings: list[str] = []

    def warning(self, msg: str) -> None:
        self.warnings.append(msg)

    def info(self, msg: str) -> None:
        pass


# --- safe loading --------------------------------------------------------------

class _Payload:
    """Unpickling this runs ``os.system`` (a real malicious pickle)."""

    def __init__(self, target: str):
        self.target = target

    def __reduce__(self) -> tuple:
        return (os.system, (f'touch {self.target}',))


@pytest.fixture
def malicious(tmp_path: Any) -> tuple[str, str]:
    target = str(tmp_path / 'pwned')
    path = str(tmp_path / 'evil.pth')
    torch.save({'state_dict': {'w': torch.ones(1)}, 'x': _Payload(target)}, path)
    return path, target


def test_malicious_pickle_is_refused_before_unpickling(malicious: tuple[str, str]) -> None:
    path, target = malicious
    with pytest.raises(CheckpointError, match=r'evil.pth references \[.*system.*arbitrary code'):
        check_pickles([path], allow_unsafe=False)
    with pytest.raises(CheckpointError, match='allow_unsafe_checkpoints=True'):
        safe_load(path)
    with pytest.raises(CheckpointError):
        read_weights(path, allow_unsafe=False)
    assert not osp.exists(target)


def test_opting_in_loads_with_full_unpickling(malicious: tuple[str, str]) -> None:
    path, target = malicious
    check_pickles([path], allow_unsafe=True)
    safe_load(path, allow_unsafe=True)
    assert osp.exists(target)  # the payload was real


def test_our_own_files_load_safely(tmp_path: Any) -> None:
    path = str(tmp_path / 'rank.pt')
    torch.save(rank_state(ToyModel()), path)
    check_pickles([path], allow_unsafe=False)
    assert 'rng' in safe_load(path)


# --- state round trips -------------------------------------------------------------

def test_message_hub_round_trip_without_pickled_classes(tmp_path: Any) -> None:
    hub = MessageHub.get_instance('roundtrip_src')
    for value in (1.0, 2.0, 3.0):
        hub.update_scalar('train/loss', value)
    hub.update_info('best_score', np.float64(0.5), resumed=True)
    hub.update_info('keep_ckpt_ids', [4, 8], resumed=True)
    path = str(tmp_path / 'hub.pt')
    torch.save(hub_state(hub), path)
    loaded = torch.load(path, weights_only=True)
    other = MessageHub.get_instance('roundtrip_dst')
    load_hub_state(other, loaded)
    assert other.get_scalar('train/loss').mean() == 2.0
    assert other.get_info('best_score') == 0.5
    assert other.get_info('keep_ckpt_ids') == [4, 8]


def test_rank_state_restores_rng_and_buffers(tmp_path: Any) -> None:
    model = ToyModel()
    model.norm.running_mean.fill_(3.0)
    path = str(tmp_path / 'rank.pt')
    torch.save(rank_state(model), path)
    expected = (random.random(), np.random.rand(), torch.rand(1))
    model.norm.running_mean.zero_()
    load_rank_state(model, torch.load(path, weights_only=True))
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected
    assert torch.equal(model.norm.running_mean, torch.full((16,), 3.0))


# --- finding the checkpoint to resume ----------------------------------------------

def test_latest_complete_skips_incomplete(tmp_path: Any) -> None:
    work = str(tmp_path)
    make_checkpoint(osp.join(work, 'iter_4.pth'), 4)
    make_checkpoint(osp.join(work, 'iter_12.pth'), 12)
    make_checkpoint(osp.join(work, 'iter_16.pth'), 16, complete=False)
    with open(osp.join(work, LAST_CHECKPOINT), 'w') as f:
        f.write(osp.join(work, 'iter_16.pth'))
    path, skipped = find_latest_complete(work)
    assert path == osp.join(work, 'iter_12.pth')
    assert skipped == [osp.join(work, 'iter_16.pth')]


def test_nothing_to_resume(tmp_path: Any) -> None:
    assert find_latest_complete(str(tmp_path)) == (None, [])


def test_inspect_text_for_an_incomplete_checkpoint(tmp_path: Any) -> None:
    text = describe(make_checkpoint(str(tmp_path / 'ck'), 7, complete=False))
    assert 'iter: 7' in text and 'complete: no (COMPLETE marker missing' in text


def test_inspect_describes_a_weights_file_of_either_format(tmp_path: Any) -> None:
    """A file is no checkpoint directory: inspect says what it holds and how to load it."""
    import json

    from safetensors.torch import save_file
    state = {'fc.weight': torch.ones(3, 2), 'fc.bias': torch.zeros(3, dtype=torch.bfloat16)}
    meta = {'iter': 8, 'zero_stage': 3, 'exported_dtype': 'fp32'}
    torch.save({'meta': meta, 'state_dict': state}, str(tmp_path / 'w.pth'))
    save_file(state, str(tmp_path / 'w.safetensors'), metadata={'meta': json.dumps(meta)})
    for name, loader in (('w.pth', 'load_checkpoint'), ('w.safetensors', 'load_file')):
        text = describe(str(tmp_path / name))
        for fragment in ('not a checkpoint directory', loader, 'iter: 8', 'zero_stage: 3',
                         'tensors: 2 (9 elements; bfloat16, float32)', 'MiB'):
            assert fragment in text, (name, text)


# --- the CheckpointHook behaviour our hook replaces -------------------------------

class _ProbeRunner(Runner):
    """A plain MMEngine Runner that records which checkpoints exist at each save."""

    seen: list[list[str]]

    def save_checkpoint(self, out_dir: str, filename: str, *args: Any, **kwargs: Any) -> None:
        self.seen.append(sorted(f for f in os.listdir(out_dir) if f.startswith('iter_')))
        super().save_checkpoint(out_dir, filename, *args, **kwargs)


@pytest.mark.parametrize(('hook', 'before_second_save'), [
    ('CheckpointHook', []),                        # MMEngine: deleted before the save (pinned)
    ('DeepSpeedCheckpointHook', ['iter_2.pth']),   # ours: still there while saving
])
def test_old_checkpoint_removal_order(tmp_path: Any, hook: str, before_second_save: list) -> None:
    import mmengine_deepspeed  # noqa: F401  registers DeepSpeedCheckpointHook

    cfg = toy_config(str(tmp_path), max_iters=4, val=False, checkpoint=dict(
        type=hook, interval=2, by_epoch=False, max_keep_ckpts=1))
    _ProbeRunner.seen = []
    runner = _ProbeRunner.from_cfg(Config(cfg))
    runner.train()
    assert _ProbeRunner.seen == [[], before_second_save]
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith('iter_')) == ['iter_4.pth']


# --- which layout changes resume supports ------------------------------------------

@pytest.mark.parametrize(('saved', 'current', 'universal'), [
    ((2, 2), (2, 2), False), ((2, 0), (1, 0), False), ((2, 2), (1, 2), True),
    ((1, 3), (2, 3), True), ((2, 1), (2, 3), True), ((2, 2), (2, 1), True)])
def test_supported_layout_changes(saved: tuple, current: tuple, universal: bool) -> None:
    assert needs_universal(Sharding(*saved), Sharding(*current), 'ck') is universal


@pytest.mark.parametrize(('saved', 'current', 'fragment'), [
    ((2, 0), (2, 2), 'between ZeRO-0 and ZeRO-1/2/3'),
    ((2, 3), (1, 0), 'between ZeRO-0 and ZeRO-1/2/3'),
    ((2, 3), (2, 2), 'cannot load a ZeRO-3 universal checkpoint into ZeRO-1/2')])
def test_unsupported_layout_changes_fail_early(saved: tuple, current: tuple,
                                               fragment: str) -> None:
    with pytest.raises(CheckpointError, match=fragment):
        needs_universal(Sharding(*saved), Sharding(*current), 'ck')


def test_resharding_needs_adam_style_optimizer_states() -> None:
    params = [torch.nn.Parameter(torch.ones(1))]
    check_reshardable(torch.optim.AdamW(params), 'ck')
    with pytest.raises(CheckpointError, match=r'Adam-style optimizer states only.*SGD cannot'):
        check_reshardable(torch.optim.SGD(params, lr=0.1), 'ck')


# --- export keeps one copy of the weights ----------------------------------------


def _merged_views() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """What zero_to_fp32 returns for ZeRO-1/2: views into one merged fp32 vector."""
    merged = torch.arange(12, dtype=torch.float32)
    return merged, {'a': merged[:6].view(2, 3), 'b': merged[6:10],
                    'steps': torch.tensor(3, dtype=torch.int64)}


def test_fp32_pth_export_keeps_the_views_without_a_second_copy(tmp_path: Any) -> None:
    from mmengine_deepspeed.checkpoint.export import cast_state_dict

    merged, state = _merged_views()
    out = cast_state_dict(state, torch.float32, standalone=False)
    assert all(out[k].data_ptr() == state[k].data_ptr() for k in state)  # no second copy
    path = str(tmp_path / 'w.pth')
    torch.save(out, path)
    loaded = torch.load(path)
    assert torch.equal(loaded['a'], merged[:6].view(2, 3))
    assert torch.equal(loaded['b'], merged[6:10])


def test_safetensors_and_cast_exports_get_tensors_of_their_own(tmp_path: Any) -> None:
    from safetensors.torch import load_file, save_file

    from mmengine_deepspeed.checkpoint.export import cast_state_dict

    merged, state = _merged_views()
    out = cast_state_dict(state, torch.float32, standalone=True)
    assert all(v.untyped_storage().nbytes() == v.nbytes for v in out.values())
    save_file(out, str(tmp_path / 'w.safetensors'))  # refuses shared memory otherwise
    assert torch.equal(load_file(str(tmp_path / 'w.safetensors'))['b'], merged[6:10])
    half = cast_state_dict(state, torch.bfloat16, standalone=True)
    assert half['a'].dtype == torch.bfloat16 and half['steps'].dtype == torch.int64
    assert half['steps'].data_ptr() == state['steps'].data_ptr()  # owns its memory already


def test_meta_that_is_not_json_names_the_file(tmp_path: Any) -> None:
    path = make_checkpoint(str(tmp_path / 'ck'))
    with open(osp.join(path, META_FILE), 'w') as f:
        f.write('{format_version: 1')
    with pytest.raises(CheckpointError, match=r'meta\.json is not valid JSON'):
        check_checkpoint(path)


def test_truncated_safetensors_names_the_file(tmp_path: Any) -> None:
    from safetensors.torch import save_file
    path = str(tmp_path / 'weights.safetensors')
    save_file(ToyModel().state_dict(), path)
    with open(path, 'rb') as f:
        data = f.read()
    with open(path, 'wb') as f:
        f.write(data[:7])
    with pytest.raises(CheckpointError, match=r'weights\.safetensors cannot be read'):
        read_weights(path, allow_unsafe=False)


def test_weights_of_another_model_are_refused(tmp_path: Any) -> None:
    """No key matches: refused, where MMEngine warns twice and trains from random weights."""
    path = str(tmp_path / 'linear.pth')
    torch.save({'state_dict': torch.nn.Linear(3, 3).state_dict()}, path)
    with pytest.raises(CheckpointError, match=r'(?s)linear\.pth matches none.*2 keys.*revise_keys'):
        load_weights_into(ToyModel(), path, strict=False, revise_keys=[], allow_unsafe=False,
                          logger=_Log())
    # a partial match still loads, with MMEngine's warnings
    partial = str(tmp_path / 'partial.pth')
    state = ToyModel().state_dict()
    torch.save({'fc1.weight': state['fc1.weight'], 'other': torch.zeros(1)}, partial)
    log = _Log()
    load_weights_into(ToyModel(), partial, strict=False, revise_keys=[], allow_unsafe=False,
                      logger=log)
    assert any('other' in m for m in log.warnings)


def test_save_failure_names_a_full_disk_and_what_resumes(tmp_path: Any) -> None:
    """The message a failed save ends the run with. A full disk cannot be made here without
    root, so the OSError it raises (ENOSPC) is constructed; everything else is real."""
    import errno

    from mmengine_deepspeed.checkpoint.save import save_failure
    work = str(tmp_path)
    failing = osp.join(work, 'iter_8.pth')
    full = OSError(errno.ENOSPC, 'No space left on device')
    message = save_failure(failing, RuntimeError('unexpected pos 9792 vs 9680'), work)
    assert f'Saving checkpoint {failing} failed' in message
    assert 'no complete checkpoint yet' in message and 'writing a file failed' in message
    wrapped = RuntimeError('basic_ios::clear: iostream error')
    wrapped.__cause__ = full
    assert 'the disk is full' in save_failure(failing, wrapped, work)


@pytest.mark.parametrize(('key', 'args'), [('backend_args', {'backend': 'petrel'}),
                                           ('file_client_args', {'backend': 'http'})])
def test_a_remote_checkpoint_backend_is_refused_by_name(key: str, args: dict) -> None:
    """Local ones (``'local'``, FileClient's ``'disk'``) are accepted
    (tests/dist/test_checkpoint_hook.py saves with one); remote ones fail before anything
    is written."""
    from mmengine_deepspeed.strategy.checkpoints import save_checkpoint

    with pytest.raises(ValueError, match=rf"CheckpointHook {key}=.* names a remote storage "
                                         rf"backend.*remove {key}"):
        save_checkpoint(object(), '/nonexistent/iter_1.pth',  # type: ignore[arg-type]
                        save_optimizer=True, save_param_scheduler=True, meta=None,
                        by_epoch=True, backends={key: args})
