#!/usr/bin/env python3
"""Benchmark ``zckpt reshard`` against ``cp -r`` of the same checkpoint on the same disk.

What it does:

1. **Make** (once) the checkpoint of ``bench_consolidate.py`` (imported from beside this file,
   nothing duplicated): a ~401M-param model, ZeRO-3, bf16, AdamW, written by real DeepSpeed at
   2 ranks on CPU. A complete checkpoint already in ``--workdir`` is reused (making one takes
   ~5 min; ``--python`` must then have deepspeed).
2. **Warm up + verify** (untimed): read every checkpoint file once, run each variant once and
   keep the reshard outputs, then check them in a child process under ``--python``:

   - ``open_training_state`` reads each output back: world size 3, the ZeRO stage asked, the
     same trainable params (names, shapes, groups), same counters, lr scheduler and step scalars;
   - for ``--sample`` params spread over the model, the fp32 master and every optimizer state
     (exp_avg, exp_avg_sq) equal the input's bit for bit (``zckpt.io.materialize.read_tensor``);
   - every output ``.pt`` file passes ``zipfile.ZipFile.testzip()`` (CRC-32 of every record),
     and, when torch and deepspeed import, loads with ``torch.load(mmap=True,
     weights_only=False)``; the ZeRO-2 model_states' bf16 weights of the sample params equal
     the masters rounded to bf16;
   - ``zckpt consolidate`` of each output equals ``zckpt consolidate`` of the input, tensor by
     tensor (safetensors ``safe_open``, one tensor at a time).
3. **Measure**: ``--repeats`` rounds of the variants in turn (cp, reshard to 3 ranks ZeRO-3,
   to 3 ranks ZeRO-2, and to 3 ranks ZeRO-3 with ``--workers 1``). Each run is a subprocess
   writing a fresh folder, deleted afterwards. Wall time is ``time.perf_counter`` around the
   child; "max 1-proc RSS" is ``ru_maxrss`` from ``os.wait4`` (the largest single process of the
   child's tree: Linux reports the max over the child and its waited-for children, not a sum);
   "tree RSS" is the peak of the summed RSS of the child and all its descendants, sampled every
   ``--sample-ms`` from ``/proc`` (reshard writes files from worker processes). After each run,
   outside its wall time, ``os.sync()`` is timed: zckpt fsyncs every file before renaming it
   into place, ``cp`` does not, so "wall+sync" is the time until the output is on disk for both.
   CPU time other processes used meanwhile (``/proc/stat`` minus the child's) flags disturbed
   runs; ``--wait-idle`` waits for a quiet machine before each run.

The children import a copy of the ``zckpt`` package taken at the start (its git commit and any
uncommitted changes are recorded), so that commits made to the repository while the benchmark
runs do not mix code versions within one measurement.

Commands measured (CKPT = the checkpoint folder holding ``latest``)::

    cp -r CKPT OUT
    PY -m zckpt reshard CKPT OUT --world-size 3 --quiet
    PY -m zckpt reshard CKPT OUT --world-size 3 --stage 2 --quiet
    PY -m zckpt reshard CKPT OUT --world-size 3 --workers 1 --quiet

Usage::

    python scripts/bench_reshard.py --python /work/venv-ds19/bin/python --repeats 3 [--json out.json]

Like ``bench_consolidate.py`` the driver needs only the standard library (everything else runs
under ``--python``), so that it stays small: a child's ``ru_maxrss`` can include the parent's
resident size at the time of the fork. The page cache cannot be dropped here
(``/proc/sys/vm/drop_caches`` is read-only in this container), so all figures are warm-cache.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_consolidate as bc  # noqa: E402  (the checkpoint maker and the shared helpers)
from bench_common import (  # noqa: E402
    Run,
    child_cwd,
    child_env,
    filesystem_of,
    print_run_header,
    run_measured,
    snapshot_zckpt,
    time_ratios,
    variant_stats,
    wait_for_quiet,
)

TARGET_WORLD = 3
# variant -> (extra reshard arguments or None for cp, ZeRO stage of the output)
VARIANTS: dict[str, tuple[list[str] | None, int | None]] = {
    "cp": (None, None),
    "reshard-z3": ([], 3),
    "reshard-z2": (["--stage", "2"], 2),
    "reshard-z3-w1": (["--workers", "1"], 3),
}
TIME_TARGET = 1.5  # reshard within 1.5x the time of cp -r
RSS_TARGET_MIB = 1024.0  # peak RSS under 1 GB


def command(variant: str, python: str, ckpt_dir: Path, out_dir: Path) -> list[str]:
    """The exact command line measured for `variant`."""
    extra, _ = VARIANTS[variant]
    if extra is None:
        return ["cp", "-r", str(ckpt_dir), str(out_dir)]
    return [
        python,
        "-m",
        "zckpt",
        "reshard",
        str(ckpt_dir),
        str(out_dir),
        "--world-size",
        str(TARGET_WORLD),
        *extra,
        "--quiet",
    ]


# --------------------------------------------------------------------------------------
# Verification (runs under --python)
# --------------------------------------------------------------------------------------
VERIFY_CODE = r"""
import importlib.util, json, sys, zipfile
from pathlib import Path
import torch
from zckpt.core.dtypes import BF16
from zckpt.deepspeed.reader import open_training_state
from zckpt.io.materialize import read_tensor
from zckpt.io.reading import FileReader

src_dir, out_dir, world, stage, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
src, out = open_training_state(src_dir), open_training_state(out_dir)
problems = []
def check(ok, text):
    if not ok:
        problems.append(text)

si, oi = src.index, out.index
check(oi.world_size == world, f"world size {oi.world_size}, expected {world}")
check(oi.zero_stage == stage, f"ZeRO stage {oi.zero_stage}, expected {stage}")
check(oi.dtype == si.dtype, f"dtype {oi.dtype}, input {si.dtype}")
check(oi.tag == si.tag, f"tag {oi.tag}, input {si.tag}")
check([e.name for e in oi.entries] == [e.name for e in si.entries], "consolidated entry names differ")
sp = {p.name: p for p in src.params}
op = {p.name: p for p in out.params}
check(sorted(sp) == sorted(op), "trainable param names differ")
for name in sp:
    if name in op:
        check((sp[name].shape, sp[name].group, sorted(sp[name].states)) == (op[name].shape, op[name].group, sorted(op[name].states)),
              f"{name}: shape/group/state names differ")
for key in ("global_steps", "global_samples", "skipped_steps", "lr_scheduler", "client_state"):
    check(repr(getattr(src, key)) == repr(getattr(out, key)), f"{key} differs")
check(out.ds_config.get("zero_optimization", {}).get("stage") == stage, "ds_config stage not updated")

def same(a, b):
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))

reader = FileReader()
for g, (gs, go) in enumerate(zip(src.groups, out.groups)):
    check(sorted(gs.scalars) == sorted(go.scalars), f"group {g}: scalar names differ")
    for key, s in gs.scalars.items():
        o = go.scalars.get(key)
        if o is None:
            continue
        if s.tensor is not None and o.tensor is not None:
            check(same(read_tensor(reader, s.tensor), read_tensor(reader, o.tensor)), f"group {g}: {key} differs")
        else:
            check(repr(s.value) == repr(o.value) and (s.tensor is None) == (o.tensor is None), f"group {g}: {key} differs")

names = [p.name for p in src.params]
picks = sorted({round(i * (len(names) - 1) / max(1, n - 1)) for i in range(n)})
sample = [names[i] for i in picks]
compared_bytes, compared_tensors = 0, 0
masters_bf16 = {}
for name in sample:
    a, b = sp[name], op.get(name)
    if b is None:
        continue
    for state in ["master", *sorted(a.states)]:
        x = read_tensor(reader, a.master if state == "master" else a.states[state])
        y = read_tensor(reader, b.master if state == "master" else b.states[state])
        check(same(x, y), f"{name}: {state} differs")
        compared_bytes += x.numel() * x.element_size()
        compared_tensors += 1
        del x, y
    masters_bf16[name] = read_tensor(reader, a.master, BF16)

files = sorted(Path(out_dir).rglob("*.pt"))
crc_ok = [str(f.relative_to(out_dir)) for f in files if zipfile.ZipFile(f).testzip() is None]
check(len(crc_ok) == len(files) and files, f"zip CRC check failed for {sorted(set(map(str, files)) - set(crc_ok))}")

torch_loaded, module_checked = [], 0
if importlib.util.find_spec("deepspeed") is not None:
    for f in files:
        sd = torch.load(f, map_location="cpu", mmap=True, weights_only=False)
        torch_loaded.append(str(f.relative_to(out_dir)))
        if stage < 3 and "module" in sd:
            for name, want in masters_bf16.items():
                got = sd["module"].get(name)
                check(got is not None and same(got, want), f"{f.name}: module weight {name} is not the master rounded to bf16")
                module_checked += 1
        del sd
reader.close()
print(json.dumps({
    "ok": not problems, "problems": problems[:20],
    "world_size": oi.world_size, "zero_stage": oi.zero_stage, "params": len(op),
    "sample_params": len(sample), "tensors_compared": compared_tensors, "bytes_compared": compared_bytes,
    "zip_crc_ok_files": len(crc_ok), "pt_files": len(files),
    "torch_loaded_files": len(torch_loaded), "module_weights_checked": module_checked,
}))
"""


def verify_reshard(python: str, ckpt_dir: Path, out_dir: Path, stage: int, sample: int) -> dict[str, Any]:
    """Read a reshard output back with zckpt and compare a sample with the input (in a child)."""
    proc = subprocess.run(
        [python, "-c", VERIFY_CODE, str(ckpt_dir), str(out_dir), str(TARGET_WORLD), str(stage), str(sample)],
        env=child_env(),
        cwd=child_cwd(),
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        return {"ok": False, "error": proc.stderr.strip().splitlines()[-8:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def consolidate(python: str, ckpt_dir: Path, out_dir: Path) -> str | None:
    """``zckpt consolidate`` into `out_dir`; an error text or None."""
    shutil.rmtree(out_dir, ignore_errors=True)
    proc = subprocess.run(
        [python, "-m", "zckpt", "consolidate", str(ckpt_dir), str(out_dir), "--quiet"],
        env=child_env(),
        cwd=child_cwd(),
        capture_output=True,
        text=True,
    )
    return None if proc.returncode == 0 else proc.stderr.strip()[-500:]


def verify_consolidated(python: str, ckpt_dir: Path, outputs: dict[str, Path], runs_dir: Path) -> dict[str, Any]:
    """consolidate(input) == consolidate(output), tensor by tensor, for each reshard output."""
    ref = runs_dir / "consolidated_input"
    error = consolidate(python, ckpt_dir, ref)
    result: dict[str, Any] = {}
    for variant, out in outputs.items():
        if error:
            result[variant] = {"identical": False, "error": f"consolidate of the input failed: {error}"}
            continue
        mine = runs_dir / f"consolidated_{variant}"
        err = consolidate(python, out, mine)
        if err:
            result[variant] = {"identical": False, "error": f"consolidate of the output failed: {err}"}
        else:
            v = bc.verify_outputs(python, mine, ref)  # same tensor-by-tensor safe_open comparison
            result[variant] = {
                ("only_in_output" if k == "only_in_zckpt" else "only_in_input" if k == "only_in_deepspeed" else k): x
                for k, x in v.items()
            }
        shutil.rmtree(mine, ignore_errors=True)
    shutil.rmtree(ref, ignore_errors=True)
    return result


# --------------------------------------------------------------------------------------
# Summary and report
# --------------------------------------------------------------------------------------


def summarize(runs: list[Run], variants: list[str]) -> dict[str, Any]:
    """Per variant: medians/min/max; per reshard variant: ratios to cp and the targets."""
    out: dict[str, Any] = {v: variant_stats(runs, v) for v in variants}
    cp = out.get("cp")
    ratios, targets = {}, {}
    for v in variants:
        if v == "cp" or not out.get(v) or not cp:
            continue
        ratios[v] = time_ratios(runs, out, v, "cp")

        # met only if both the ratio of the medians and the median of the per-round ratios are
        def met(a: float, b: float | None) -> bool:
            return a <= TIME_TARGET and b is not None and b <= TIME_TARGET

        targets[v] = {
            f"wall_le_{TIME_TARGET}x_cp": met(ratios[v]["wall"], ratios[v]["wall_per_round_median"]),
            f"wall_plus_sync_le_{TIME_TARGET}x_cp": met(
                ratios[v]["wall_plus_sync"], ratios[v]["wall_plus_sync_per_round_median"]
            ),
            "tree_rss_lt_1GiB": out[v]["tree_rss_mib"]["max"] < RSS_TARGET_MIB,
        }
    out["ratio_over_cp"] = ratios
    out["target_met"] = targets
    return out


def print_report(result: dict[str, Any]) -> None:
    """The human-readable table."""
    s, c = result["summary"], result["checkpoint"]
    variants = result["variants"]
    print_run_header(result)
    print(
        f"checkpoint: {c['path']} ({c['tag']}), {result['model']['params']:,} params, ZeRO-3 bf16, "
        f"2 ranks; {c['total_bytes'] / 1e9:.2f} GB on disk in {len(c['files'])} files"
    )
    print(
        f"page cache: warm (all files read once: {result['warm_read_s']:.1f} s; one untimed run of "
        f"each variant); cannot be dropped here"
    )
    print(
        f"rounds: {result['repeats']} (in turn: {' / '.join(variants)}); load average before/after: "
        f"{result['loadavg_before']} / {result['loadavg_after']}"
    )
    if result["busy_during_measurement"]:
        print("WARNING: other heavy jobs ran during the measurement:")
        for line in result["busy_during_measurement"]:
            print(f"  {line}")
    print()
    for var in variants:
        print(f"  {var:14s}: {' '.join(command(var, 'PY', Path('CKPT'), Path('OUT')))}")
    print()
    hdr = (
        f"{'variant':14s} {'runs':>4s} {'wall med':>9s} {'min':>6s} {'max':>6s} {'+sync med':>10s} "
        f"{'cpu med':>8s} {'1-proc RSS':>11s} {'tree RSS med':>13s} {'max':>6s} {'written':>8s}"
    )
    print(hdr)
    print("-" * len(hdr))
    for var in variants:
        t = s.get(var)
        if not t:
            print(f"{var:14s} all runs failed")
            continue
        w, ws = t["wall_s"], t["wall_plus_sync_s"]
        print(
            f"{var:14s} {t['ok_runs']:>4d} {w['median']:>8.2f}s {w['min']:>5.2f}s {w['max']:>5.2f}s "
            f"{ws['median']:>9.2f}s {t['cpu_s']['median']:>7.2f}s {t['max_proc_rss_mib']['median']:>7.0f} MiB "
            f"{t['tree_rss_mib']['median']:>9.0f} MiB {t['tree_rss_mib']['max']:>6.0f} "
            f"{t['output_bytes'] / 1e9:>6.2f}GB"
        )
    print()
    for var, r in s["ratio_over_cp"].items():
        tm = s["target_met"][var]
        per = ", ".join(f"{x:.2f}" for x in r["wall_per_round"])
        print(
            f"{var} / cp: wall {r['wall']:.2f}x (median of per-round ratios {r['wall_per_round_median']:.2f}x: "
            f"{per}) -> {'meets' if tm[f'wall_le_{TIME_TARGET}x_cp'] else 'MISSES'} <= {TIME_TARGET}x; "
            f"wall+sync {r['wall_plus_sync']:.2f}x (per round {r['wall_plus_sync_per_round_median']:.2f}x) -> "
            f"{'meets' if tm[f'wall_plus_sync_le_{TIME_TARGET}x_cp'] else 'MISSES'}; CPU {r['cpu']:.1f}x; "
            f"tree RSS max {s[var]['tree_rss_mib']['max']:.0f} MiB -> "
            f"{'meets' if tm['tree_rss_lt_1GiB'] else 'MISSES'} < 1 GiB"
        )
    print()
    for var, ver in result["verification"].items():
        cons = result["consolidate_check"].get(var, {})
        if ver.get("ok"):
            print(
                f"verification {var}: ok - world size {ver['world_size']}, ZeRO-{ver['zero_stage']}, "
                f"{ver['params']} params; {ver['tensors_compared']} tensors of {ver['sample_params']} sampled "
                f"params bit-identical ({ver['bytes_compared'] / 1e6:.0f} MB); zip CRCs ok in "
                f"{ver['zip_crc_ok_files']}/{ver['pt_files']} files; torch.load ok for "
                f"{ver['torch_loaded_files']}; {ver['module_weights_checked']} bf16 module weights checked"
            )
        else:
            print(f"verification {var}: FAILED - {json.dumps(ver)}")
        if cons.get("identical"):
            print(
                f"  consolidate(output) == consolidate(input): {cons['tensors_a']} tensors bit-identical "
                f"({cons['bytes_compared'] / 1e9:.2f} GB)"
            )
        else:
            print(f"  consolidate check FAILED: {json.dumps(cons)}")
    for var, files in result["output_files"].items():
        print(f"  {var} wrote: {', '.join(files)}")
    for r in result["runs"]:
        if r["returncode"] != 0:
            print(f"\n{r['variant']} round {r['round']} failed (exit {r['returncode']}):\n{r['log_tail']}")
    print(f"(driver's own peak RSS: {result['driver_peak_rss_mib']:.0f} MiB)")
    print("=" * 100)


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--workdir",
        type=Path,
        default=bc.DEFAULT_WORKDIR,
        help=f"where the checkpoint and the run outputs live (default {bc.DEFAULT_WORKDIR})",
    )
    p.add_argument(
        "--params", type=int, default=bc.DEFAULT_PARAMS, help="minimum model size in params (default %(default)s)"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed rounds of each variant (default 3)")
    p.add_argument(
        "--python",
        default=sys.executable,
        help="interpreter with torch and zckpt (and deepspeed, to make the checkpoint "
        "and for the torch.load check; default: this one)",
    )
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {', '.join(VARIANTS)} (default: all)"
    )
    p.add_argument("--sample", type=int, default=20, help="params whose tensors are compared (default 20)")
    p.add_argument(
        "--sample-ms", type=float, default=50.0, help="RSS sampling interval of the process tree (default 50 ms)"
    )
    p.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each timed run, wait up to this long until other processes use under "
        "0.3 CPUs (default 0: do not wait; disturbed runs are flagged either way)",
    )
    p.add_argument(
        "--skip-make", action="store_true", help="never make the checkpoint; fail if no complete one is in --workdir"
    )
    p.add_argument("--skip-verify", action="store_true", help="no warm-up outputs check")
    p.add_argument("--json", type=Path, help="also write the results here as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Make/reuse the checkpoint, warm up and verify, measure, print (and save) the results."""
    args = parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or "cp" not in variants:
        sys.exit(f"--variants must include cp and name only {', '.join(VARIANTS)} (got {unknown or variants})")

    workdir: Path = args.workdir.resolve()
    ckpt_dir = workdir / f"z3_bf16_ws2_{args.params}" / "checkpoint"
    meta_path = ckpt_dir.parent / "bench_meta.json"
    if not bc.checkpoint_complete(ckpt_dir, meta_path, args.params):
        if args.skip_make:
            sys.exit(f"--skip-make given but no complete checkpoint at {ckpt_dir}")
        meta = bc.make_checkpoint(args.python, ckpt_dir, meta_path, args.params)
    else:
        meta = json.loads(meta_path.read_text())
        print(f"reusing checkpoint {ckpt_dir} (made in {meta['make_seconds']} s on {meta['made_at']})")
    ckpt = bc.checkpoint_facts(ckpt_dir)
    facts = bc.machine_facts(args.python)
    filesystem = filesystem_of(workdir)
    runs_dir = workdir / "reshard_runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    sample_s = args.sample_ms / 1000.0
    source = snapshot_zckpt(args.python, workdir / "zckpt_snapshot", runs_dir)
    print(
        f"measuring a snapshot of {source['zckpt_package']} at {source['commit']}"
        f"{' + uncommitted changes' if source['dirty_files'] else ''} (copied to {source['snapshot']})",
        flush=True,
    )
    if bc.busy_processes():
        print("note: fixture generation is running; timings will be disturbed:", *bc.busy_processes(), sep="\n  ")

    print("warming page cache ...", flush=True)
    warm_s = bc.warm_page_cache(ckpt_dir)
    print("untimed warm-up run of each variant ...", flush=True)
    warm: dict[str, Run] = {}
    for var in variants:
        out = runs_dir / f"warm_{var}"
        keep = var != "cp" and not args.skip_verify
        warm[var] = run_measured(
            var, command(var, args.python, ckpt_dir, out), out, runs_dir / f"warm_{var}.log", 0, sample_s, keep=keep
        )
        print(f"  warm-up {var}: {warm[var].wall_s:.2f} s, exit {warm[var].returncode}", flush=True)

    verification: dict[str, Any] = {}
    consolidate_check: dict[str, Any] = {}
    if not args.skip_verify:
        print("verifying the outputs ...", flush=True)
        outs = {}
        for var in variants:
            if var == "cp":
                continue
            out = runs_dir / f"warm_{var}"
            if warm[var].returncode != 0:
                verification[var] = {"ok": False, "error": warm[var].log_tail}
                continue
            verification[var] = verify_reshard(args.python, ckpt_dir, out, VARIANTS[var][1], args.sample)
            outs[var] = out
            print(f"  {var}: {'ok' if verification[var].get('ok') else 'FAILED'}", flush=True)
        consolidate_check = verify_consolidated(args.python, ckpt_dir, outs, runs_dir)
        for var, v in consolidate_check.items():
            print(f"  consolidate {var}: {'identical' if v.get('identical') else 'DIFFERENT'}", flush=True)
        for var in variants:
            shutil.rmtree(runs_dir / f"warm_{var}", ignore_errors=True)
        os.sync()

    loadavg_before = [round(x, 2) for x in os.getloadavg()]
    window_note = 2.5
    runs: list[Run] = []
    for rnd in range(1, args.repeats + 1):
        for var in variants:
            out = runs_dir / f"{var}_{rnd}"
            waited = wait_for_quiet(args.wait_idle) if args.wait_idle else 0.0
            if waited > window_note:
                print(f"  (waited {waited:.0f} s for the machine to quieten)", flush=True)
            r = run_measured(
                var, command(var, args.python, ckpt_dir, out), out, runs_dir / f"{var}_{rnd}.log", rnd, sample_s
            )
            runs.append(r)
            print(
                f"  round {rnd} {var:14s}: wall {r.wall_s:6.2f} s (+sync {r.sync_s:5.2f} s), cpu "
                f"{r.cpu_user_s:5.2f}u+{r.cpu_sys_s:5.2f}s, tree RSS {r.tree_rss_mib:5.0f} MiB "
                f"({r.tree_procs} procs), 1-proc {r.max_proc_rss_mib:5.0f} MiB, others {r.other_cpu_s:4.1f} "
                f"CPU-s, exit {r.returncode}"
                f"{'  (DISTURBED)' if r.disturbed else ''}",
                flush=True,
            )
    loadavg_after = [round(x, 2) for x in os.getloadavg()]
    busy = [
        f"round {r.round} {r.variant}: other processes used {r.other_cpu_s:.1f} CPU-s during its "
        f"{r.wall_s:.1f} s (or a make_sample_ckpts job ran)"
        for r in runs
        if r.disturbed
    ]

    result: dict[str, Any] = {
        "argv": [sys.executable, *sys.argv] if argv is None else ["bench_reshard.py", *argv],
        "machine": facts,
        "zckpt_source": source,
        "filesystem": filesystem,
        "model": meta,
        "checkpoint": ckpt,
        "variants": variants,
        "repeats": args.repeats,
        "warm_read_s": warm_s,
        "warmup_runs": [asdict(r) for r in warm.values()],
        "verification": verification,
        "consolidate_check": consolidate_check,
        "output_files": {v: r.output_files for v, r in warm.items() if v != "cp"},
        "runs": [asdict(r) for r in runs],
        "summary": summarize(runs, variants),
        "loadavg_before": loadavg_before,
        "loadavg_after": loadavg_after,
        "busy_during_measurement": busy,
        "driver_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "commands": {v: command(v, args.python, ckpt_dir, Path("OUT")) for v in variants},
    }
    print_report(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"results written to {args.json}")
    ok = (
        all(r.returncode == 0 for r in runs)
        and all(v.get("ok") for v in verification.values())
        and all(v.get("identical") for v in consolidate_check.values())
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
