#!/usr/bin/env python3
"""Benchmark ``zckpt to-universal`` against DeepSpeed's ``ds_to_universal`` and ``cp -r``.

Issue target: on a >= 400M-param ZeRO-3 bf16 checkpoint made by real DeepSpeed (2 ranks),
``zckpt to-universal`` takes at most 0.1x the time of ``ds_to_universal --inject_missing_state``
measured in the same run, with no more peak RSS; its time against ``cp -r`` of the input (the
I/O floor) is reported too.

What it does:

1. **Checkpoint**: by default the one of ``bench_consolidate.py`` (imported from beside this
   file): a ~401M-param model, ZeRO-3, bf16, AdamW, written by real DeepSpeed at 2 ranks on CPU
   into ``--workdir`` and reused from there (making it takes ~5 min; ``--python`` must then have
   deepspeed). ``--ckpt PATH`` measures an existing checkpoint folder instead (the folder holding
   ``latest``; never written to).
2. **Warm up + verify** (untimed): read every checkpoint file once, run each variant once, keep
   the zckpt and DeepSpeed outputs and compare them in a child under ``--python``: the same
   params under ``zero/``, and for every param (or ``--sample`` of them spread over the model)
   ``fp32``, ``exp_avg`` and ``exp_avg_sq`` equal bit for bit, values compared flattened
   (DeepSpeed's ZeRO-3 files hold a flat 1-D tensor; a file holding a dict is read at its
   ``'param'`` key); ``latest_universal`` names the same folder. Files that only one tool writes,
   shape and dict-key differences, and whether the shared non-param files (``model_states``,
   ``optimizer_state.pt``) are byte-identical are reported but do not fail the check.
3. **Measure**: rounds of the variants in turn (``--repeats`` for cp and zckpt,
   ``--ds-repeats`` for DeepSpeed, which takes ~1 min a run here). Each run is a subprocess
   writing a fresh folder, deleted afterwards; measured as in ``bench_reshard.py``
   (``bench_common.run_measured``): wall time, CPU, ``ru_maxrss`` (largest single process),
   peak summed RSS and PSS of the process tree sampled from ``/proc`` (``ds_to_universal`` forks
   worker processes that share pages with their parent: RSS counts those in every process, PSS
   once), then ``os.sync()`` timed outside the wall time. Before every run (untimed) the input
   is read again: this machine's DAMON ``pageout`` scheme evicts page cache left idle for ~30 s,
   so without it the run after a 1-minute ``ds_to_universal`` would read a cold input
   (``--no-reread`` turns this off; the re-read time, ~1 s warm, shows the cache state).

Commands measured (CKPT = the checkpoint folder holding ``latest``, TAG = its tag; OUT fresh)::

    cp -r CKPT OUT                                                             # cp
    PY -m zckpt to-universal CKPT OUT --quiet                                  # zckpt
    PY -m zckpt to-universal CKPT OUT --workers 1 --quiet                      # zckpt-w1
    PY -m deepspeed.checkpoint.ds_to_universal --input_folder CKPT/TAG \\
        --output_folder OUT/TAG_universal --inject_missing_state               # ds

Usage::

    python scripts/bench_universal.py --python /work/venv-ds19/bin/python --skip-make \\
        --repeats 3 --ds-repeats 3 --json results.json
    python scripts/bench_universal.py --python /work/venv-ds19/bin/python \\
        --ckpt /tmp/small/checkpoint --workdir /tmp/ubench --variants cp,ds     # try it small

The children import a copy of the ``zckpt`` package taken at the start (as in
``bench_reshard.py``). The driver needs only the standard library. The page cache cannot be
dropped here, so all figures are warm-cache.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_consolidate as bc  # noqa: E402  (the checkpoint maker and machine facts)
from bench_common import (  # noqa: E402
    Run,
    child_cwd,
    child_env,
    damon_reclaim,
    filesystem_of,
    print_run_header,
    run_measured,
    snapshot_zckpt,
    time_ratios,
    variant_stats,
    wait_for_quiet,
)

VARIANTS = ("cp", "zckpt", "zckpt-w1", "ds")
ZCKPT_VARIANTS = ("zckpt", "zckpt-w1")
TIME_TARGET = 0.1  # zckpt within 0.1x the wall time of ds_to_universal
STATES = ("fp32", "exp_avg", "exp_avg_sq")


@dataclass
class URun(Run):
    """A measured run plus the peak summed PSS of its process tree."""

    tree_pss_mib: float | None = None
    reread_s: float | None = None  # untimed re-read of the input just before the run


def command(
    variant: str,
    python: str,
    ckpt_dir: Path,
    tag: str,
    out_dir: Path,
    tag_given: bool = False,
    ds_args: list[str] | None = None,
) -> list[str]:
    """The exact command line measured for `variant`."""
    if variant == "cp":
        return ["cp", "-r", str(ckpt_dir), str(out_dir)]
    if variant in ZCKPT_VARIANTS:
        return [
            python,
            "-m",
            "zckpt",
            "to-universal",
            str(ckpt_dir),
            str(out_dir),
            *(["--tag", tag] if tag_given else []),
            *(["--workers", "1"] if variant == "zckpt-w1" else []),
            "--quiet",
        ]
    return [
        python,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(ckpt_dir / tag),
        "--output_folder",
        str(out_dir / f"{tag}_universal"),
        "--inject_missing_state",
        *(ds_args or []),
    ]


# --------------------------------------------------------------------------------------
# Verification (runs under --python)
# --------------------------------------------------------------------------------------
VERIFY_CODE = r"""
import filecmp, json, sys
from pathlib import Path
import torch

z_root, d_root, tag, n = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
zdir, ddir = z_root / f"{tag}_universal", d_root / f"{tag}_universal"
STATES = ("fp32", "exp_avg", "exp_avg_sq")
problems, notes = [], []

def latest(root):
    p = root / "latest_universal"
    return p.read_text().strip() if p.is_file() else None

lz, ld = latest(z_root), latest(d_root)
if lz != ld:
    problems.append(f"latest_universal: zckpt {lz!r}, deepspeed {ld!r}")

def params(d):
    zero = d / "zero"
    return sorted(str(p.parent.relative_to(zero)) for p in zero.rglob("fp32.pt")) if zero.is_dir() else []

pz, pd = params(zdir), params(ddir)
only_z, only_d = sorted(set(pz) - set(pd)), sorted(set(pd) - set(pz))
if only_z or only_d or not pd:
    problems.append(f"param sets differ: {len(pz)} in zckpt, {len(pd)} in deepspeed")
common = [p for p in pd if p in set(pz)]
if n > 0 and n < len(common):
    common = [common[i] for i in sorted({round(i * (len(common) - 1) / max(1, n - 1)) for i in range(n)})]

def value(obj):
    if isinstance(obj, dict):
        return obj.get("param"), sorted(k for k in obj if k != "param")
    return obj, None

def flat_bytes(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)

compared, nbytes, different, shape_diff, key_diff, dtypes = 0, 0, [], 0, [], {}
for name in common:
    for state in STATES:
        fz, fd = zdir / "zero" / name / f"{state}.pt", ddir / "zero" / name / f"{state}.pt"
        if not fz.is_file() or not fd.is_file():
            different.append(f"{name}/{state}: missing in {'zckpt' if not fz.is_file() else 'deepspeed'}")
            continue
        (x, kx), (y, ky) = value(torch.load(fz, map_location="cpu", weights_only=False)), \
                           value(torch.load(fd, map_location="cpu", weights_only=False))
        if not torch.is_tensor(x) or not torch.is_tensor(y):
            different.append(f"{name}/{state}: not a tensor ({type(x).__name__}, {type(y).__name__})")
            continue
        if kx != ky:
            key_diff.append(f"{name}/{state}: zckpt keys {kx}, deepspeed keys {ky}")
        if tuple(x.shape) != tuple(y.shape):
            shape_diff += 1
        same = x.dtype == y.dtype and x.numel() == y.numel() and torch.equal(flat_bytes(x), flat_bytes(y))
        if not same:
            different.append(f"{name}/{state}: zckpt {x.dtype} {tuple(x.shape)}, deepspeed {y.dtype} {tuple(y.shape)}"
                             + (", values differ" if x.dtype == y.dtype and x.numel() == y.numel() else ""))
        compared += 1
        nbytes += y.numel() * y.element_size()
        dtypes[str(y.dtype)] = dtypes.get(str(y.dtype), 0) + 1
        del x, y
if different:
    problems.append(f"{len(different)} of {compared} tensors differ")

def others(d):
    skip = {f"zero/{p}/{s}.pt" for p in params(d) for s in STATES}
    return {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()} - skip

oz, od = others(zdir), others(ddir)
identical_files = sorted(f for f in oz & od if filecmp.cmp(zdir / f, ddir / f, shallow=False))
differing_files = sorted((oz & od) - set(identical_files))
param_groups_equal = None
if (zdir / "zero/optimizer_state.pt").is_file() and (ddir / "zero/optimizer_state.pt").is_file():
    try:
        a = torch.load(zdir / "zero/optimizer_state.pt", map_location="cpu", weights_only=False, mmap=True)
        b = torch.load(ddir / "zero/optimizer_state.pt", map_location="cpu", weights_only=False, mmap=True)
        param_groups_equal = repr(a.get("param_groups")) == repr(b.get("param_groups"))
        notes.append(f"optimizer_state.pt keys: zckpt {sorted(map(str, a))}, deepspeed {sorted(map(str, b))}")
        del a, b
    except Exception as e:
        notes.append(f"optimizer_state.pt not compared: {type(e).__name__}: {e}")

print(json.dumps({
    "ok": not problems, "problems": problems,
    "params_zckpt": len(pz), "params_deepspeed": len(pd),
    "only_in_zckpt": only_z[:20], "only_in_deepspeed": only_d[:20],
    "params_compared": len(common), "tensors_compared": compared, "bytes_compared": nbytes, "dtypes": dtypes,
    "different": different[:20], "n_different": len(different),
    "shape_differs": shape_diff, "dict_key_differences": key_diff[:5], "n_dict_key_differences": len(key_diff),
    "latest_universal": [lz, ld],
    "other_files_only_in_zckpt": sorted(oz - od), "other_files_only_in_deepspeed": sorted(od - oz),
    "other_files_identical": identical_files, "other_files_differing": differing_files,
    "param_groups_equal": param_groups_equal, "notes": notes,
}))
"""


def verify(python: str, zckpt_out: Path, ds_out: Path, tag: str, sample: int) -> dict[str, Any]:
    """Compare zckpt's output with ds_to_universal's, tensor by tensor (in a child)."""
    proc = subprocess.run(
        [python, "-c", VERIFY_CODE, str(zckpt_out), str(ds_out), tag, str(sample)],
        env=child_env(),
        cwd=child_cwd(),
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        return {"ok": False, "error": proc.stderr.strip().splitlines()[-8:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------
# Summary and report
# --------------------------------------------------------------------------------------
def summarize(runs: list[URun], variants: list[str], rss_key: str) -> dict[str, Any]:
    """Per variant: medians/min/max; per zckpt variant: ratios to DeepSpeed and to cp, targets."""
    out: dict[str, Any] = {v: variant_stats(runs, v) for v in variants}

    def ratios(num: str, den: str) -> dict[str, Any] | None:
        res = time_ratios(runs, out, num, den)
        if res is None:
            return None
        a, b = out[num], out[den]
        if den != "cp":
            for key in ("max_proc_rss_mib", "tree_rss_mib", "tree_pss_mib"):
                if a.get(key) and b.get(key):
                    res[key.replace("_mib", "")] = a[key]["median"] / b[key]["median"]
        return res

    over_ds = {v: ratios(v, "ds") for v in variants if v in ZCKPT_VARIANTS}
    over_cp = {v: ratios(v, "cp") for v in variants if v != "cp"}
    out["ratio_over_ds"] = {v: r for v, r in over_ds.items() if r}
    out["ratio_over_cp"] = {v: r for v, r in over_cp.items() if r}
    targets = {}
    for v, r in out["ratio_over_ds"].items():
        per = r["wall_per_round_median"]
        # time met only if both the ratio of the medians and the median of per-round ratios are;
        # RSS met if the peak (max over runs) is no more than DeepSpeed's smallest peak
        targets[v] = {
            f"wall_le_{TIME_TARGET}x_ds": r["wall"] <= TIME_TARGET and (per is None or per <= TIME_TARGET),
            f"{rss_key}_le_ds": out[v][rss_key]["max"] <= out["ds"][rss_key]["min"],
            "max_proc_rss_le_ds": out[v]["max_proc_rss_mib"]["max"] <= out["ds"]["max_proc_rss_mib"]["min"],
        }
    out["target_met"] = targets
    out["rss_measure_for_target"] = rss_key
    return out


def print_report(result: dict[str, Any]) -> None:
    """The human-readable tables."""
    s, c = result["summary"], result["checkpoint"]
    variants = result["variants"]
    print_run_header(result)
    params = result["model"].get("params")
    print(
        f"checkpoint: {c['path']} ({result['tag']}), "
        f"{f'{params:,} params' if params else 'params: see the checkpoint'}; "
        f"{c['total_bytes'] / 1e9:.2f} GB on disk in {len(c['files'])} files"
    )
    rr = [r["reread_s"] for r in result["runs"] if r.get("reread_s") is not None]
    print(
        f"page cache: warm (all files read once: {result['warm_read_s']:.1f} s; one untimed run of each "
        f"variant"
        + (f"; input re-read before every run, {min(rr):.1f}-{max(rr):.1f} s" if rr else "")
        + "); cannot be dropped here"
    )
    if result.get("damon_reclaim"):
        print(f"note: proactive reclaim is on ({result['damon_reclaim']}): idle page cache is evicted")
    print(
        f"rounds: {result['repeats']} of cp/zckpt, {result['ds_repeats']} of ds (in turn: "
        f"{' / '.join(variants)}); load average before/after: {result['loadavg_before']} / "
        f"{result['loadavg_after']}"
    )
    if result["busy_during_measurement"]:
        print("WARNING: other processes were busy during some runs:")
        for line in result["busy_during_measurement"]:
            print(f"  {line}")
    print()
    for var in variants:
        shown = command(
            var, "PY", Path("CKPT"), "TAG", Path("OUT"), "--tag" in result["commands"].get(var, []), result["ds_args"]
        )
        print(f"  {var:9s}: {' '.join(shown)}")
    print()
    pss = any(s.get(var) and s[var].get("tree_pss_mib") for var in variants)
    hdr = (
        f"{'variant':9s} {'runs':>4s} {'wall med':>9s} {'min':>7s} {'max':>7s} {'+sync med':>10s} "
        f"{'cpu med':>8s} {'1-proc RSS':>11s} {'tree RSS':>10s}{' tree PSS' if pss else ''} {'written':>8s}"
    )
    print(hdr + "   (RSS/PSS: medians of the per-run peaks, MiB)")
    print("-" * len(hdr))
    for var in variants:
        t = s.get(var)
        if not t:
            print(f"{var:9s} all runs failed")
            continue
        w, ws = t["wall_s"], t["wall_plus_sync_s"]
        pss_col = f" {t['tree_pss_mib']['median']:>8.0f}" if pss and t.get("tree_pss_mib") else ""
        print(
            f"{var:9s} {t['ok_runs']:>4d} {w['median']:>8.2f}s {w['min']:>6.2f}s {w['max']:>6.2f}s "
            f"{ws['median']:>9.2f}s {t['cpu_s']['median']:>7.2f}s {t['max_proc_rss_mib']['median']:>11.0f} "
            f"{t['tree_rss_mib']['median']:>10.0f}{pss_col} {t['output_bytes'] / 1e9:>6.2f}GB"
        )
    print()
    for var, r in s["ratio_over_ds"].items():
        tm = s["target_met"][var]
        per = ", ".join(f"{x:.3f}" for x in r["wall_per_round"])
        wkey = f"wall_le_{TIME_TARGET}x_ds"
        rkey = f"{s['rss_measure_for_target']}_le_ds"
        print(
            f"{var} / ds: wall {r['wall']:.3f}x (per-round median {r['wall_per_round_median']:.3f}x: {per}) -> "
            f"{'meets' if tm[wkey] else 'MISSES'} <= {TIME_TARGET}x; wall+sync {r['wall_plus_sync']:.3f}x; "
            f"CPU {r['cpu']:.3f}x"
        )
        print(
            f"{'':{len(var)}s}        peak RSS: 1-proc {r.get('max_proc_rss', float('nan')):.3f}x "
            f"({'meets' if tm['max_proc_rss_le_ds'] else 'MISSES'}), tree {r.get('tree_rss', float('nan')):.3f}x"
            + (f", tree PSS {r['tree_pss']:.3f}x" if r.get("tree_pss") else "")
            + f" ({s['rss_measure_for_target'].replace('_mib', '')}: {'meets' if tm[rkey] else 'MISSES'} "
            f"<= DeepSpeed's)"
        )
    for var, r in s["ratio_over_cp"].items():
        print(
            f"{var} / cp: wall {r['wall']:.2f}x (per-round median {r['wall_per_round_median']:.2f}x), "
            f"wall+sync {r['wall_plus_sync']:.2f}x (per round {r['wall_plus_sync_per_round_median']:.2f}x), "
            f"CPU {r['cpu']:.2f}x"
        )
    print()
    ver = result["verification"]
    if not ver:
        print("verification: not done")
    elif ver.get("ok"):
        print(
            f"verification: ok - {ver['params_compared']} of {ver['params_deepspeed']} params, "
            f"{ver['tensors_compared']} tensors ({', '.join(STATES)}) bit-identical to ds_to_universal's "
            f"({ver['bytes_compared'] / 1e9:.2f} GB, {ver['dtypes']}); same param set; latest_universal "
            f"{ver['latest_universal'][0]!r}"
        )
    else:
        print(f"verification: FAILED - {json.dumps(ver)}")
    if ver and "shape_differs" in ver:
        print(
            f"  (not checked) shapes differ for {ver['shape_differs']} tensors (values compared flattened); "
            f"dict keys differ for {ver['n_dict_key_differences']}{': ' + ver['dict_key_differences'][0] if ver['dict_key_differences'] else ''}"
        )
        print(
            f"  other files: identical {ver['other_files_identical']}; differing {ver['other_files_differing']}; "
            f"only zckpt {ver['other_files_only_in_zckpt']}; only deepspeed {ver['other_files_only_in_deepspeed']}; "
            f"optimizer param_groups equal: {ver['param_groups_equal']}"
        )
    for var, files in result["output_file_counts"].items():
        print(f"  {var} wrote {files} files")
    for r in result["runs"] + result["warmup_runs"]:
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
        "--ckpt",
        type=Path,
        help="measure this existing checkpoint folder (the one holding 'latest') instead of "
        "making/reusing the benchmark checkpoint in --workdir; it is only read",
    )
    p.add_argument("--tag", help="checkpoint tag (default: the one 'latest' names; passed to zckpt only if given)")
    p.add_argument(
        "--params",
        type=int,
        default=bc.DEFAULT_PARAMS,
        help="minimum model size in params of the made checkpoint (default %(default)s)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed rounds of cp and zckpt (default 3)")
    p.add_argument(
        "--ds-repeats",
        type=int,
        help="timed rounds of ds_to_universal (default: --repeats; ~1 min each on the 400M checkpoint)",
    )
    p.add_argument(
        "--python", default=sys.executable, help="interpreter with torch, deepspeed and zckpt (default: this one)"
    )
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {', '.join(VARIANTS)} (default: all)"
    )
    p.add_argument(
        "--ds-args",
        default="",
        help="extra arguments for ds_to_universal, e.g. '--num_extract_workers 2' "
        "(default none: its defaults, 4 extract and 2 merge workers)",
    )
    p.add_argument(
        "--sample",
        type=int,
        default=0,
        help="params whose tensors are compared, spread over the model (default 0: all)",
    )
    p.add_argument(
        "--sample-ms", type=float, default=50.0, help="RSS/PSS sampling interval of the process tree (default 50 ms)"
    )
    p.add_argument(
        "--pss-ms",
        type=float,
        default=250.0,
        help="PSS sampling interval of the process tree (/proc/PID/smaps_rollup, costlier than "
        "RSS; default 250 ms); 0: no PSS, and the RSS target then uses the summed RSS",
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
    p.add_argument(
        "--no-reread",
        action="store_true",
        help="do not re-read the input (untimed) right before each run; by default it is, since "
        "this machine's DAMON pageout evicts page cache idle for ~30 s, which would leave "
        "the run after a 1-minute ds_to_universal reading a cold input",
    )
    p.add_argument("--skip-verify", action="store_true", help="do not compare the warm-up outputs")
    p.add_argument(
        "--keep-warm",
        action="store_true",
        help="keep the warm-up outputs (in WORKDIR/universal_runs/warm_*) for inspection",
    )
    p.add_argument("--json", type=Path, help="also write the results here as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Make/reuse the checkpoint, warm up and verify, measure, print (and save) the results."""
    args = parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        sys.exit(f"--variants must name only {', '.join(VARIANTS)} (got {unknown or variants})")
    variants = [v for v in VARIANTS if v in variants]  # fixed order
    ds_repeats = args.repeats if args.ds_repeats is None else args.ds_repeats
    ds_args = shlex.split(args.ds_args)
    pss = args.pss_ms > 0
    pss_s = args.pss_ms / 1000.0 if pss else None
    rss_key = "tree_pss_mib" if pss else "tree_rss_mib"

    workdir: Path = args.workdir.resolve()
    if args.ckpt:
        ckpt_dir = args.ckpt.resolve()
        if not (ckpt_dir / "latest").is_file() and not args.tag:
            sys.exit(f"{ckpt_dir} has no 'latest' file; give --tag")
        meta_path = ckpt_dir.parent / "bench_meta.json"
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {"params": None}
    else:
        ckpt_dir = workdir / f"z3_bf16_ws2_{args.params}" / "checkpoint"
        meta_path = ckpt_dir.parent / "bench_meta.json"
        if not bc.checkpoint_complete(ckpt_dir, meta_path, args.params):
            if args.skip_make:
                sys.exit(f"--skip-make given but no complete checkpoint at {ckpt_dir}")
            meta = bc.make_checkpoint(args.python, ckpt_dir, meta_path, args.params)
        else:
            meta = json.loads(meta_path.read_text())
            print(f"reusing checkpoint {ckpt_dir} (made in {meta['make_seconds']} s on {meta['made_at']})")
    tag = args.tag or (ckpt_dir / "latest").read_text().strip()
    if not (ckpt_dir / tag).is_dir():
        sys.exit(f"no tag folder {ckpt_dir / tag}")
    ckpt = (
        bc.checkpoint_facts(ckpt_dir)
        if (ckpt_dir / "latest").is_file()
        else {
            "path": str(ckpt_dir),
            "tag": tag,
            "total_bytes": bc.dir_size(ckpt_dir),
            "tag_bytes": bc.dir_size(ckpt_dir / tag),
            "files": {
                str(p.relative_to(ckpt_dir)): p.stat().st_size for p in sorted(ckpt_dir.rglob("*")) if p.is_file()
            },
        }
    )
    facts = bc.machine_facts(args.python)
    runs_dir = workdir / "universal_runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(runs_dir).free
    need = 3 * ckpt["tag_bytes"]
    if free < need:
        print(
            f"WARNING: {free / 1e9:.1f} GB free under {runs_dir}; the warm-up outputs and "
            f"ds_to_universal's temporary files need about {need / 1e9:.1f} GB",
            flush=True,
        )
    sample_s = args.sample_ms / 1000.0
    source = snapshot_zckpt(args.python, workdir / "zckpt_snapshot_universal", runs_dir)
    print(
        f"measuring a snapshot of {source['zckpt_package']} at {source['commit']}"
        f"{' + uncommitted changes' if source['dirty_files'] else ''} (copied to {source['snapshot']})",
        flush=True,
    )
    if any(v in ZCKPT_VARIANTS for v in variants):
        probe = subprocess.run(
            [args.python, "-m", "zckpt", "to-universal", "--help"],
            env=child_env(),
            cwd=child_cwd(),
            capture_output=True,
            text=True,
        )
        if probe.returncode != 0:
            sys.exit(
                "this zckpt has no working 'to-universal' command "
                f"({(probe.stderr or probe.stdout).strip().splitlines()[-1:]}); "
                "measure the others with --variants cp,ds"
            )

    def cmd(var: str, out: Path) -> list[str]:
        return command(var, args.python, ckpt_dir, tag, out, bool(args.tag), ds_args)

    print("warming page cache ...", flush=True)
    warm_s = bc.warm_page_cache(ckpt_dir)
    print("untimed warm-up run of each variant ...", flush=True)
    warm: dict[str, URun] = {}
    for var in variants:
        out = runs_dir / f"warm_{var}"
        keep = args.keep_warm or (var in ("zckpt", "ds") and not args.skip_verify)
        reread = None if args.no_reread else bc.warm_page_cache(ckpt_dir)
        warm[var] = run_measured(
            var, cmd(var, out), out, runs_dir / f"warm_{var}.log", 0, sample_s, keep=keep, pss_s=pss_s, cls=URun
        )
        warm[var].reread_s = reread
        print(
            f"  warm-up {var}: {warm[var].wall_s:.2f} s, tree RSS {warm[var].tree_rss_mib:.0f} MiB, "
            f"exit {warm[var].returncode}",
            flush=True,
        )

    verification: dict[str, Any] = {}
    if not args.skip_verify and "zckpt" in variants and "ds" in variants:
        print("comparing zckpt's output with ds_to_universal's ...", flush=True)
        if warm["zckpt"].returncode or warm["ds"].returncode:
            verification = {
                "ok": False,
                "error": "a warm-up run failed",
                "tails": {v: warm[v].log_tail for v in ("zckpt", "ds") if warm[v].returncode},
            }
        else:
            verification = verify(args.python, runs_dir / "warm_zckpt", runs_dir / "warm_ds", tag, args.sample)
        print(f"  {'ok' if verification.get('ok') else 'FAILED'}", flush=True)
    if not args.keep_warm:
        for var in variants:
            shutil.rmtree(runs_dir / f"warm_{var}", ignore_errors=True)
        os.sync()

    loadavg_before = [round(x, 2) for x in os.getloadavg()]
    runs: list[URun] = []
    for rnd in range(1, max(args.repeats, ds_repeats) + 1):
        for var in variants:
            if rnd > (ds_repeats if var == "ds" else args.repeats):
                continue
            out = runs_dir / f"{var}_{rnd}"
            waited = wait_for_quiet(args.wait_idle) if args.wait_idle else 0.0
            if waited > 2.5:
                print(f"  (waited {waited:.0f} s for the machine to quieten)", flush=True)
            reread = None if args.no_reread else bc.warm_page_cache(ckpt_dir)
            r = run_measured(
                var, cmd(var, out), out, runs_dir / f"{var}_{rnd}.log", rnd, sample_s, pss_s=pss_s, cls=URun
            )
            r.reread_s = reread
            runs.append(r)
            print(
                f"  round {rnd} {var:9s}: wall {r.wall_s:7.2f} s (+sync {r.sync_s:5.2f} s), cpu "
                f"{r.cpu_user_s:6.2f}u+{r.cpu_sys_s:5.2f}s, 1-proc {r.max_proc_rss_mib:5.0f} MiB, tree RSS "
                f"{r.tree_rss_mib:5.0f} MiB"
                + (f" PSS {r.tree_pss_mib:5.0f} MiB" if pss else "")
                + f" ({r.tree_procs} procs), others {r.other_cpu_s:4.1f} CPU-s, exit {r.returncode}"
                + (f", input re-read {reread:.1f} s before" if reread is not None else "")
                + ("  (DISTURBED)" if r.disturbed else ""),
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
        "argv": [sys.executable, *sys.argv] if argv is None else ["bench_universal.py", *argv],
        "machine": facts,
        "zckpt_source": source,
        "filesystem": filesystem_of(workdir),
        "damon_reclaim": damon_reclaim(),
        "reread_before_each_run": not args.no_reread,
        "model": meta,
        "checkpoint": ckpt,
        "tag": tag,
        "variants": variants,
        "repeats": args.repeats,
        "ds_repeats": ds_repeats,
        "warm_read_s": warm_s,
        "warmup_runs": [asdict(r) for r in warm.values()],
        "verification": verification,
        "output_file_counts": {v: len(r.output_files) for v, r in warm.items()},
        "output_files": {v: r.output_files[:50] for v, r in warm.items() if v != "cp"},
        "runs": [asdict(r) for r in runs],
        "summary": summarize(runs, variants, rss_key),
        "loadavg_before": loadavg_before,
        "loadavg_after": loadavg_after,
        "busy_during_measurement": busy,
        "driver_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "commands": {v: cmd(v, Path("OUT")) for v in variants},
        "ds_args": ds_args,
    }
    print_report(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"results written to {args.json}")
    ok = (
        all(r.returncode == 0 for r in runs)
        and all(r.returncode == 0 for r in warm.values())
        and (not verification or bool(verification.get("ok")))
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
