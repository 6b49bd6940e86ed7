"""Nsight Compute's warp-stall samples of a kernel, by SASS instruction, by opcode and by reason.

    ncu --profile-from-start off --clock-control none --section SourceCounters --section WarpStateStats \\
        -o plain python3 ...          # one kernel of interest in the profiled range
    ncu --import plain.ncu-rep --page source --csv --print-source sass > plain.csv
    python3 benchmarks/ncu_stalls.py plain.csv [pairs.csv ...] [--top 22]

For each CSV (the source page of one profiled kernel): its samples in all, the ``--top``
instructions with most samples (address, warp-level executions, the SASS, its main stall
reasons), and the samples summed by opcode and by stall reason. Given two or more CSVs, the
opcode and reason sums stand side by side, one column a CSV, so that what grew from one build to
the other shows (round 68 found the clusters' four-warp loader this way: issue stalls, not
waiting). Samples are counts, not time: compare kernels' shares, or their counts where both ran
the same work."""

import argparse
import collections
import csv
import os

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
REASON_PREFIX = "stall_"


def read(path: str) -> tuple:
    """(kernel name, rows): each row {"address", "sass", "opcode", "samples", "executed", "reasons"},
    ``reasons`` {reason: samples} of all samples (not only those that did not issue)."""
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    named = bool(lines) and lines[0][:1] == ["Kernel Name"]  # (ncu's source page starts with it)
    kernel = lines[0][1] if named else "?"
    header, body = lines[named], lines[named + 1:]
    reasons = [(i, name[len(REASON_PREFIX):]) for i, name in enumerate(header)
               if name.startswith(REASON_PREFIX) and "(Not Issued)" not in name]
    at = {name: i for i, name in enumerate(header)}
    rows = []
    for line in body:
        if len(line) < len(header):
            continue
        sass = line[at["Source"]].strip()
        words = sass.split()
        # the opcode: past a predicate (@P0, @!UP1) and without its modifiers (IMAD.WIDE -> IMAD)
        opcode = next((w for w in words if not w.startswith("@")), "").split(".")[0]
        rows.append(dict(address=line[at["Address"]], sass=sass, opcode=opcode, samples=_int(line[at[SAMPLES]]),
                         executed=_int(line[at[EXECUTED]]),
                         reasons={name: count for name, count in ((name, _int(line[i])) for i, name in reasons)
                                  if count}))
    return kernel, rows


def _int(text: str) -> int:
    return int(text.replace(",", "")) if text.strip() not in ("", "-") else 0


def sums(rows: list) -> tuple:
    """(samples by opcode, samples by reason), each a Counter."""
    by_opcode, by_reason = collections.Counter(), collections.Counter()
    for row in rows:
        by_opcode[row["opcode"]] += row["samples"]
        by_reason.update(row["reasons"])
    return by_opcode, by_reason


def report(path: str, top: int) -> str:
    kernel, rows = read(path)
    total = sum(row["samples"] for row in rows) or 1
    out = [f"== {os.path.basename(path)} ({kernel}): {total} samples"]
    for row in sorted(rows, key=lambda r: -r["samples"])[:top]:
        main = sorted(row["reasons"].items(), key=lambda kv: -kv[1])[:3]
        out.append(f"{100 * row['samples'] / total:5.1f}% {row['samples']:7d} {row['address']} "
                   f"ex={row['executed']:9d}  {row['sass'][:60]:60s} {main}")
    by_opcode, by_reason = sums(rows)
    out.append("by opcode: " + ", ".join(f"{k} {v}" for k, v in by_opcode.most_common(15)))
    out.append("by reason: " + ", ".join(f"{k} {v}" for k, v in by_reason.most_common(12)))
    return "\n".join(out)


def side_by_side(paths: list, count: int = 20) -> str:
    """The opcode and reason sums of several CSVs, one column each, ordered by the largest."""
    names = [os.path.basename(p).removesuffix(".csv") for p in paths]
    common = len(os.path.commonprefix(names))
    names = [name[common:] or name for name in names]  # what tells them apart
    tables = [sums(read(p)[1]) for p in paths]
    out = []
    for title, which in (("opcode", 0), ("reason", 1)):
        keys = collections.Counter()
        for table in tables:
            keys.update(table[which])
        out.append(f"{title:>18} " + " ".join(f"{name:>{max(len(name), 8)}}" for name in names))
        for key, _ in keys.most_common(count):
            out.append(f"{key:>18} " + " ".join(f"{table[which][key]:{max(len(name), 8)}d}"
                                                for name, table in zip(names, tables)))
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csvs", nargs="+", help="ncu's source page of one kernel each, as CSV")
    parser.add_argument("--top", type=int, default=22, help="instructions to list a kernel")
    args = parser.parse_args()
    for path in args.csvs:
        print(report(path, args.top), end="\n\n")
    if len(args.csvs) > 1:
        print(side_by_side(args.csvs))


if __name__ == "__main__":
    main()
