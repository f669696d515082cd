"""Pipeline-parallel checkpoints against DeepSpeed's own PipelineModule (issue 19). Needs DeepSpeed:
``pytest -m deepspeed -p interop_helpers tests/test_interop/test_interop_pipeline.py``.

zckpt consolidates a 2-stage pipeline checkpoint under the names the model's ``state_dict()`` has
when built as one stage. Here DeepSpeed builds that model (the samples' PipelineModule with
``num_stages=1``, from scripts/make_parallel_ckpts.py) and loads the consolidated file with
``strict=True``: its keys, in its order, are the independent fact. One single-process run (~10 s).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from helpers import PIPELINE_SAMPLES, ROOT, Sample

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("DeepSpeed is not installed", allow_module_level=True)

from interop_helpers import (  # noqa: E402,F401 (autouse fixture)
    ds_env,
    ds_python,
    free_port,
    run_logged,
    shm_leak_safety_net,
)
from zckpt import consolidate  # noqa: E402
from zckpt.deepspeed.reader import open_checkpoint  # noqa: E402

WORKER = r"""
import json, sys
from pathlib import Path

import deepspeed
from safetensors.torch import load_file

sys.path.insert(0, sys.argv[1])
from make_parallel_ckpts import Case, build_pipeline

deepspeed.init_distributed(dist_backend="gloo")
out = Path(sys.argv[2])
for name in sys.argv[3:]:
    module = build_pipeline(Case(name, 1, "fp32", pp=1, dp=1))
    weights = load_file(str(out / name / "model.safetensors"))
    missing, unexpected = module.load_state_dict(weights, strict=True)
    (out / name / "one_stage.json").write_text(json.dumps({"keys": list(module.state_dict()), "loaded": True}))
"""


@pytest.fixture(scope="module")
def one_stage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Each sample consolidated by zckpt, then loaded by the one-stage PipelineModule."""
    out = tmp_path_factory.mktemp("pipeline")
    for case in PIPELINE_SAMPLES:
        consolidate(case.checkpoint, out / case.name)
    script = out / "worker.py"
    script.write_text(WORKER)
    python = ds_python()
    cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(free_port())]
    cmd += [str(script), str(ROOT / "scripts"), str(out), *(c.name for c in PIPELINE_SAMPLES)]
    log = out / "run.log"
    returncode = run_logged(cmd, ds_env(1, python), log, timeout=600)
    if returncode != 0:
        pytest.fail(
            f"DeepSpeed run: exit {returncode}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        )
    return out


@pytest.mark.parametrize("case", PIPELINE_SAMPLES, ids=[s.name for s in PIPELINE_SAMPLES])
def test_the_one_stage_model_loads_the_consolidated_weights(one_stage: Path, case: Sample) -> None:
    found = json.loads((one_stage / case.name / "one_stage.json").read_text())
    assert found["loaded"]  # strict: no key missing, none unexpected, every shape right
    assert open_checkpoint(case.checkpoint).names() == found["keys"]
