"""Summarise an Nsight Compute source page (``ncu -i X.ncu-rep --page source --print-source sass --csv``).

For one kernel: executed instructions and stall samples by opcode, the hottest lines with their
top stall reasons, and (``--per-iteration N``) the instructions executed exactly ``N`` times (one
loop trip of every warp) grouped by opcode: what one iteration of the main loop issues.

    python tools/benchmarking/ncu_sass_summary.py src.csv --kernel rlk_attn_fwd_wg --per-iteration 1032192
"""

from __future__ import annotations

import argparse
import collections
import csv
from pathlib import Path


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def read_rows(path: Path, kernel: str) -> list[dict]:
    rows, cur, hdr = [], None, None
    with path.open() as f:
        for r in csv.reader(f):
            if len(r) >= 2 and r[0] == "Kernel Name":
                cur, hdr = r[1], None
            elif r and r[0] == "Address":
                hdr = r
            elif cur == kernel and hdr and len(r) == len(hdr):
                rows.append(dict(zip(hdr, r)))
    return rows


def opcode(source: str) -> str:
    parts = source.split()
    if not parts:
        return "?"
    op = parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]
    return op.split(".")[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", type=Path)
    ap.add_argument("--kernel", required=True)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--per-iteration", type=int, default=None, help="execution count of one loop trip")
    args = ap.parse_args(argv)
    rows = read_rows(args.csv, args.kernel)
    if not rows:
        ap.error(f"no SASS rows for kernel {args.kernel!r} in {args.csv}")
    ex_key, st_key = "Instructions Executed", "Warp Stall Sampling (All Samples)"
    tot_ex = sum(_num(r[ex_key]) for r in rows) or 1.0
    tot_st = sum(_num(r[st_key]) for r in rows) or 1.0
    ex, st = collections.Counter(), collections.Counter()
    for r in rows:
        ex[opcode(r["Source"])] += _num(r[ex_key])
        st[opcode(r["Source"])] += _num(r[st_key])
    print(f"{args.kernel}: {len(rows)} SASS lines, {tot_ex:.0f} warp instructions executed, {tot_st:.0f} stall samples")
    for op, n in ex.most_common(args.top):
        print(f"  {op:12s} {100 * n / tot_ex:6.2f} % of executed  {100 * st[op] / tot_st:6.2f} % of samples")
    stall_keys = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    print("hottest lines (share of samples, executions, top stall reasons):")
    for r in sorted(rows, key=lambda r: -_num(r[st_key]))[:args.top]:
        top = sorted(((_num(r[k]), k[6:]) for k in stall_keys), reverse=True)[:3]
        print(f"  {100 * _num(r[st_key]) / tot_st:5.2f} % {_num(r[ex_key]):>11.0f}  {r['Source'][:64]:64s} "
              + ", ".join(f"{k} {v:.0f}" for v, k in top))
    if args.per_iteration:
        trip = collections.Counter(opcode(r["Source"]) for r in rows if _num(r[ex_key]) == args.per_iteration)
        print(f"one loop trip ({args.per_iteration} executions): {sum(trip.values())} instructions")
        print("  " + ", ".join(f"{op} {n}" for op, n in trip.most_common()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
