"""Interop: the ``zero_optimization`` table zckpt is held to (tests/zero_field_cases.py) is what
DeepSpeed 0.19.8's own DeepSpeedZeroConfig accepts and refuses, and zckpt's reading of each
section agrees with DeepSpeed's, case by case (issue 35 item 5).

Run: ``PYTHONPATH=tests DS_ACCELERATOR=cpu python -m pytest -m deepspeed -p interop_helpers tests/test_interop/test_interop_zero_fields.py``
"""

from __future__ import annotations

import copy
import importlib.util

import pytest

from zckpt.core.errors import ZckptError
from zckpt.deepspeed.run_config import read_run_config
from zero_field_cases import ZERO_CASES

pytestmark = [pytest.mark.deepspeed]

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("DeepSpeed is not installed", allow_module_level=True)


def _deepspeed_accepts(section: dict) -> bool:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    try:
        DeepSpeedZeroConfig(**copy.deepcopy(section))
    except Exception:  # noqa: BLE001 (refused, whatever the kind: pydantic, assertion)
        return False
    return True


def _zckpt_accepts(section: dict) -> bool:
    try:
        read_run_config({"zero_optimization": copy.deepcopy(section)})
    except ZckptError:
        return False
    return True


@pytest.mark.parametrize("section,accepted", [c[1:3] for c in ZERO_CASES], ids=[c[0] for c in ZERO_CASES])
def test_deepspeed_and_zckpt_agree(section: dict, accepted: bool) -> None:
    assert _deepspeed_accepts(section) == accepted
    assert _zckpt_accepts(section) == accepted
