#!/usr/bin/env python3
"""Round-trip check of ``zckpt train`` checkpoints across world sizes (see zckpt/trainer/roundtrip.py).

    python scripts/roundtrip.py --from-world 2 --to-world 3 --steps 8 --save-at 4 --dtype bf16
    python scripts/roundtrip.py --nvme --dim 256 --layers 1 --sub-group-size 800000   # NVMe offload

Prints a table of what matched; exits 1 on any mismatch, 2 on bad options.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from-world", type=int, default=2)
    parser.add_argument("--to-world", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="last step of the run")
    parser.add_argument("--save-at", type=int, default=4, help="the step the checkpoint is saved at")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--micro-batch", type=int, default=3, help="at --from-world ranks")
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=61)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--sub-group-size", type=int, default=2000)
    parser.add_argument("--tie-embeddings", action="store_true")
    parser.add_argument(
        "--nvme",
        action="store_true",
        help="every run offloads its optimizer state to a swap folder in the work folder "
        "(sub-groups of at least 1 MiB fp32 per rank are swapped: pick --dim and --sub-group-size so some are)",
    )
    parser.add_argument(
        "--nvme-params",
        action="store_true",
        help="with --nvme, the param shares too (those of at least 1 MiB per rank)",
    )
    parser.add_argument("--work-dir", help="keep the checkpoints here (default: a temporary folder)")
    args = parser.parse_args(argv)

    from zckpt.core.errors import ZckptError
    from zckpt.trainer.config import TrainConfig
    from zckpt.trainer.roundtrip import render, roundtrip

    try:
        config = TrainConfig(
            steps=args.steps,
            dtype=args.dtype,
            micro_batch=args.micro_batch,
            grad_accum=args.grad_accum,
            layers=args.layers,
            dim=args.dim,
            heads=args.heads,
            vocab=args.vocab,
            seq_len=args.seq_len,
            sub_group_size=args.sub_group_size,
            tie_embeddings=args.tie_embeddings,
            lr=3e-3,
            warmup=2,
        )
        report = roundtrip(
            config,
            args.from_world,
            args.to_world,
            args.save_at,
            args.work_dir,
            nvme=args.nvme or args.nvme_params,
            nvme_params=args.nvme_params,
        )
    except ZckptError as exc:
        print(f"roundtrip: error: {exc}", file=sys.stderr)
        return 2
    print(render(report))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
