"""engine/banner.py: the engine's start-up lines."""
from __future__ import annotations

from typing import Any

from mmengine_deepspeed.engine import banner


def test_emulated_bf16_is_named_with_its_cost_and_the_fix(monkeypatch: Any) -> None:
    """The CPU probe is replaced: this machine's CPU may compute bf16 natively."""
    monkeypatch.setattr(banner, 'native_bf16', lambda: False)
    note = banner.precision_note(True, 'bf16', on_cuda=False)
    assert note is not None and 'emulated' in note and '"auto"' in note and 'slower' in note
    assert 'training in fp32' in str(banner.precision_note('auto', 'fp32', on_cuda=False))
    assert banner.precision_note(False, 'fp32', on_cuda=False) is None
    assert banner.precision_note(True, 'bf16', on_cuda=True) is None
    monkeypatch.setattr(banner, 'native_bf16', lambda: True)
    assert banner.precision_note(True, 'bf16', on_cuda=False) is None
