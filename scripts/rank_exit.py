"""How a torchrun rank of the scripts here ends once its outputs are written.

torch 2.13's gloo threads can abort the interpreter's exit ("terminate called without an active
exception": SIGABRT), which torchrun then reports as a failed run although every output is
written: seen in hf_trainer_run.py under CI, and in the DeepSpeed and Lightning workers. A rank
that is done passes one more barrier and leaves with ``os._exit``, skipping that teardown
(ds_probe.py, ds_train_gpt.py and fsdp2_resume.py do the same inline). Stdlib only.
"""

from __future__ import annotations

import os
import sys


def leave(code: int = 0) -> None:
    """Exit this process with `code` at once, after a barrier with the other ranks if they are
    in a process group; output flushed."""
    try:
        dist = sys.modules.get("torch.distributed")
        if code == 0 and dist is not None and dist.is_available() and dist.is_initialized():
            dist.barrier()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
