"""``zero_optimization`` sections and whether DeepSpeed 0.19.8's DeepSpeedZeroConfig accepts them
(runtime/zero/config.py, runtime/zero/offload_config.py): the fields zckpt does not use but checks
as DeepSpeed does (issue 35 item 5), beside a few it uses. Shared by the default tier
(tests/test_deepspeed/test_zero_fields.py: zckpt agrees with the table) and the interop tier
(tests/test_interop/test_interop_zero_fields.py: DeepSpeed agrees with it). Every section names
its stage: the checks that depend on it are made where the stage is known."""

from __future__ import annotations

from typing import Any

ACCEPTED, REFUSED = True, False


def _z(stage: int = 3, **fields: Any) -> dict[str, Any]:
    return {"stage": stage, **fields}


def _opt(stage: int = 3, **fields: Any) -> dict[str, Any]:
    return _z(stage, offload_optimizer={"device": "cpu", **fields})


# (id, section, accepted by DeepSpeed, the key a refusal names)
ZERO_CASES: list[tuple[str, dict[str, Any], bool, str]] = [
    ("plain", _z(), ACCEPTED, ""),
    ("persistence -1", _z(stage3_param_persistence_threshold=-1), REFUSED, "stage3_param_persistence_threshold"),
    ("persistence 0", _z(stage3_param_persistence_threshold=0), ACCEPTED, ""),
    ("persistence text", _z(stage3_param_persistence_threshold="5"), ACCEPTED, ""),
    ("persistence 5.5", _z(stage3_param_persistence_threshold=5.5), REFUSED, "stage3_param_persistence_threshold"),
    ("persistence null", _z(stage3_param_persistence_threshold=None), REFUSED, "stage3_param_persistence_threshold"),
    ("persistence auto", _z(stage3_param_persistence_threshold="auto"), ACCEPTED, ""),
    ("persistence true", _z(stage3_param_persistence_threshold=True), ACCEPTED, ""),
    ("persistence 2**63", _z(stage3_param_persistence_threshold=2**63), ACCEPTED, ""),
    ("persistence 1e30", _z(stage3_param_persistence_threshold=1e30), REFUSED, "stage3_param_persistence_threshold"),
    (
        "persistence text -1",
        _z(stage3_param_persistence_threshold=" -1 "),
        REFUSED,
        "stage3_param_persistence_threshold",
    ),
    ("persistence by name -1", _z(param_persistence_threshold=-1), REFUSED, "param_persistence_threshold"),
    (
        "persistence name and alias",
        _z(param_persistence_threshold=5, stage3_param_persistence_threshold=5),
        REFUSED,
        "param_persistence_threshold",
    ),
    ("reduce bucket 0", _z(reduce_bucket_size=0), REFUSED, "reduce_bucket_size"),
    ("reduce bucket 1", _z(reduce_bucket_size=1), ACCEPTED, ""),
    ("allgather bucket 0", _z(allgather_bucket_size=0), ACCEPTED, ""),
    ("allgather bucket -1", _z(allgather_bucket_size=-1), REFUSED, "allgather_bucket_size"),
    ("prefetch -1", _z(stage3_prefetch_bucket_size=-1), REFUSED, "stage3_prefetch_bucket_size"),
    ("model persistence -1", _z(stage3_model_persistence_threshold=-1), REFUSED, "stage3_model_persistence_threshold"),
    ("max live -1", _z(stage3_max_live_parameters=-1), REFUSED, "stage3_max_live_parameters"),
    ("max live 1e9 text", _z(stage3_max_live_parameters="1e9"), REFUSED, "stage3_max_live_parameters"),
    ("max live 1e9 float", _z(stage3_max_live_parameters=1e9), ACCEPTED, ""),
    ("max reuse -1", _z(stage3_max_reuse_distance=-1), REFUSED, "stage3_max_reuse_distance"),
    ("granularity -5", _z(stage3_module_granularity_threshold=-5), ACCEPTED, ""),
    ("hpz -1", _z(zero_hpz_partition_size=-1), REFUSED, "zero_hpz_partition_size"),
    ("hpz 0", _z(zero_hpz_partition_size=0), ACCEPTED, ""),
    ("sub group -1", _z(sub_group_size=-1), REFUSED, "sub_group_size"),
    ("contiguous null", _z(contiguous_gradients=None), REFUSED, "contiguous_gradients"),
    ("contiguous yes", _z(contiguous_gradients="yes"), ACCEPTED, ""),
    ("contiguous 2", _z(contiguous_gradients=2), REFUSED, "contiguous_gradients"),
    ("overlap null", _z(overlap_comm=None), ACCEPTED, ""),
    ("overlap maybe", _z(overlap_comm="maybe"), REFUSED, "overlap_comm"),
    ("grad norm off at 3", _z(3, compute_grad_norm=False), REFUSED, "compute_grad_norm"),
    ("grad norm off at 2", _z(2, compute_grad_norm=False), ACCEPTED, ""),
    ("grad norm off at 1", _z(1, compute_grad_norm="off"), ACCEPTED, ""),
    ("grad norm off at 0", _z(0, compute_grad_norm=0), REFUSED, "compute_grad_norm"),
    ("fp32 weights off", _z(load_from_fp32_weights="off"), ACCEPTED, ""),
    ("gather 16bit 1", _z(stage3_gather_16bit_weights_on_model_save=1), ACCEPTED, ""),
    (
        "gather fp16 beside 16bit",
        _z(stage3_gather_fp16_weights_on_model_save=True, gather_16bit_weights_on_model_save=True),
        REFUSED,
        "stage3_gather_fp16_weights_on_model_save",
    ),
    ("gather fp16 alone", _z(stage3_gather_fp16_weights_on_model_save=True), ACCEPTED, ""),
    ("pin memory null (deprecated)", _z(cpu_offload_use_pin_memory=None), ACCEPTED, ""),
    ("quantized gradients x", _z(zero_quantized_gradients="x"), REFUSED, "zero_quantized_gradients"),
    ("muon buffer 1.0", _z(save_muon_momentum_buffer_in_memory=1.0), ACCEPTED, ""),
    ("ratio 0.5 at 3", _opt(ratio=0.5), ACCEPTED, ""),
    ("ratio 0.5 at 2", _opt(2, ratio=0.5), REFUSED, "ratio"),
    ("ratio 1 at 2", _opt(2, ratio=1), ACCEPTED, ""),
    ("ratio 1.5", _opt(ratio=1.5), REFUSED, "ratio"),
    ("ratio -0.1", _opt(ratio=-0.1), REFUSED, "ratio"),
    ("ratio text", _opt(ratio="0.5"), ACCEPTED, ""),
    ("ratio text 5.", _opt(ratio="5."), REFUSED, "ratio"),
    ("ratio text .5", _opt(ratio=" .5 "), ACCEPTED, ""),
    ("ratio text 1e-1", _opt(ratio="1e-1"), ACCEPTED, ""),
    ("ratio text nan", _opt(ratio="nan"), REFUSED, "ratio"),
    ("ratio true", _opt(ratio=True), ACCEPTED, ""),
    ("ratio null", _opt(ratio=None), REFUSED, "ratio"),
    ("cores 1.5", _opt(cpuadam_cores_perc=1.5), REFUSED, "cpuadam_cores_perc"),
    ("cores 0", _opt(cpuadam_cores_perc=0), ACCEPTED, ""),
    ("super offload x", _opt(super_offload="x"), REFUSED, "super_offload"),
    ("optimizer pin null", _opt(pin_memory=None), REFUSED, "pin_memory"),
    ("param pin no", _z(offload_param={"device": "cpu", "pin_memory": "no"}), ACCEPTED, ""),
    ("param pin null", _z(offload_param={"device": "cpu", "pin_memory": None}), REFUSED, "pin_memory"),
    ("param buffer count -1", _z(offload_param={"device": "cpu", "buffer_count": -1}), REFUSED, "buffer_count"),
]
