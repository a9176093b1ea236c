"""engine/compile.py: MMEngine's ``compile`` key read as DeepSpeedRunner applies it."""
from __future__ import annotations

from typing import Any

import pytest
from mmengine.config import Config

from mmengine_deepspeed import DeepSpeedRunner
from mmengine_deepspeed.engine.compile import compile_options
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
