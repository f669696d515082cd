"""zckpt refuses, in one line naming the key and the constraint, every ``zero_optimization``
value DeepSpeed 0.19.8's config model refuses, for the fields it checks, and accepts the rest
(the table: tests/zero_field_cases.py; DeepSpeed's agreement: the interop tier)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import run_cli, sample
from zckpt.core.errors import CorruptFileError, UsageError
from zckpt.deepspeed.run_config import read_run_config
from zero_field_cases import ZERO_CASES


@pytest.mark.parametrize("section,accepted,key", [c[1:] for c in ZERO_CASES], ids=[c[0] for c in ZERO_CASES])
def test_zckpt_reads_the_zero_section_as_deepspeed(section: dict, accepted: bool, key: str) -> None:
    config = {"zero_optimization": section}
    if accepted:
        read_run_config(config)
        return
    with pytest.raises(UsageError) as refused:
        read_run_config(config, "ds.json")
    message = str(refused.value)
    assert "\n" not in message and message.startswith("ds.json: zero_optimization.")
    assert f"{key} = " in message and "DeepSpeed" in message, message


def test_a_saved_config_is_left_to_the_release_that_wrote_it() -> None:
    """A checkpoint's own config passed its DeepSpeed's checks; a field zckpt does not use is
    not held against the checkpoint (an older release may have read it otherwise)."""
    read_run_config({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": -1}}, saved=True)
    with pytest.raises(CorruptFileError):  # the fields zckpt uses still are
        read_run_config({"zero_optimization": {"stage": 3, "sub_group_size": -1}}, saved=True)


def test_the_stage_a_command_gives_decides(tmp_path: Path) -> None:
    """compute_grad_norm false with no stage in the config: judged at the stage reshard writes."""
    from zckpt.ops.reshard import plan_reshard

    checkpoint = sample("z2_fp32_ws1").checkpoint
    config = {"zero_optimization": {"compute_grad_norm": False}, "gradient_clipping": 0.0}
    read_run_config(config)  # the stage is not the config's to say here
    assert plan_reshard(checkpoint, world_size=2, stage=2, config=config).target.stage == 2
    with pytest.raises(UsageError, match="compute_grad_norm = false: DeepSpeed accepts false at ZeRO stage 1 or 2"):
        plan_reshard(
            checkpoint,
            world_size=2,
            stage=3,
            config={
                **config,
                "zero_optimization": {"compute_grad_norm": False, "offload_optimizer": {"device": "none"}},
            },
        )


@pytest.mark.slow
def test_reshard_config_with_a_negative_threshold_is_refused(tmp_path: Path) -> None:
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": -1}}')
    result = run_cli(
        "reshard",
        sample("z3_fp32_ws2_tied_frozen").checkpoint,
        tmp_path / "out",
        "-w",
        "2",
        "--config",
        "ds.json",
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr
    assert "stage3_param_persistence_threshold = -1: DeepSpeed requires at least 0" in result.stderr
    assert not (tmp_path / "out").exists()
