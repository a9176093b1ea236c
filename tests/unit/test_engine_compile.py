"""engine/compile.py: MMEngine's ``compile`` key read as DeepSpeedRunner applies it."""
from __future__ import annotations

from typing import Any

import pytest
from deepspeed.compile import util as deepcompile_util
from mmengine.config import Config

from mmengine_deepspeed import DeepSpeedRunner, DsConfigError
from mmengine_deepspeed.engine.compile import check_deepcompile, compile_options
from tests.helpers import toy_config


@pytest.mark.parametrize(('value', 'options'), [
    (None, None), (False, None), (True, {}),
    ({'backend': 'aot_eager', 'dynamic': False}, {'backend': 'aot_eager', 'dynamic': False}),
])
def test_compile_key_as_mmengine_reads_it(value: Any, options: Any) -> None:
    assert compile_options(value) == options


def test_a_bad_compile_value_fails_before_any_process_work(tmp_path: Any) -> None:
    from mmengine_deepspeed import dist

    work_dir = tmp_path / 'never_created'
    cfg = dict(toy_config(str(work_dir)), compile='yes')
    worlds = dist._worlds_created[0]
    with pytest.raises(TypeError, match=r"compile='yes': give True, or the options"):
        DeepSpeedRunner.from_cfg(Config(cfg))
    assert not work_dir.exists()
    assert dist._worlds_created[0] == worlds


DEEPCOMPILE = {'zero_optimization': {'stage': 3}, 'compile': {'deepcompile': True}}


def _build(tmp_path: Any, **cfg_keys: Any) -> None:
    from mmengine_deepspeed import dist

    work_dir = tmp_path / 'never_created'
    worlds = dist._worlds_created[0]
    try:
        DeepSpeedRunner.from_cfg(Config(dict(toy_config(str(work_dir), ds_config=DEEPCOMPILE),
                                             **cfg_keys)))
    finally:
        assert not work_dir.exists()
        assert dist._worlds_created[0] == worlds


def test_deepcompile_without_the_compile_key_fails_early(tmp_path: Any) -> None:
    """DeepSpeed compiles only in engine.compile(), which MMEngine's compile key calls:
    without it, compile.deepcompile would be ignored without a word."""
    with pytest.raises(DsConfigError, match=r'compile.deepcompile is true, but nothing is '
                                            r"compiled without MMEngine's compile key: add "
                                            r'compile=True'):
        _build(tmp_path)


@pytest.mark.skipif(deepcompile_util.is_deepcompile_supported(),
                    reason='DeepCompile is supported here (CUDA, torch >= 2.6)')
def test_deepcompile_where_deepspeed_cannot_build_it_fails_early(tmp_path: Any) -> None:
    """On CPU, engine.compile() with DeepCompile dies in the first iteration compiling
    DeepSpeed's CUDA sources (``cuda.h: No such file or directory``)."""
    with pytest.raises(DsConfigError, match=r'DeepCompile for CUDA with torch >= 2.6 only '
                                            r'\(here: cpu, torch .*\): remove compile.deepcompile'):
        _build(tmp_path, compile=True)


def test_deepcompile_with_the_compile_key_where_supported_passes(monkeypatch: Any) -> None:
    """DeepSpeed's support probe replaced (this machine has no CUDA): with the compile key
    and a supporting machine, the config goes to DeepSpeed as it is."""
    monkeypatch.setattr(deepcompile_util, 'is_deepcompile_supported', lambda: True)
    check_deepcompile({}, [DEEPCOMPILE])
    check_deepcompile(None, [{'compile': {'deepcompile': False}}, {}])
