"""Summarises the wasm benchmark runs of scripts/bench into Markdown tables.

    python3 summarise.py RESULTS_DIR

Reads RESULTS_DIR/wasm-<variant>-<engine>-r<round>.tsv (the program's output) and
wasm-sizes.tsv; for every (variant, engine, case, measurement) keeps the best median over the
rounds (the least disturbed by other load on the machine) and prints it in µs, with MB/s of
body. Standard library only.
"""

import collections
import csv
import pathlib
import re
import sys

NAME = re.compile(r"^wasm-(?P<variant>.+)-(?P<engine>native|wasmtime|v8)-r(?P<round>\d+)\.tsv$")


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = pathlib.Path(sys.argv[1])
    best: dict[tuple[str, str, str, str], float] = {}
    body: dict[str, int] = {}
    rounds: dict[tuple[str, str], int] = collections.Counter()
    for f in sorted(out.glob("wasm-*-r*.tsv")):
        m = NAME.match(f.name)
        if not m:
            continue
        rounds[(m["variant"], m["engine"])] += 1
        with f.open() as fh:
            for row in csv.DictReader(fh, delimiter="\t"):
                key = (m["variant"], m["engine"], row["case"], row["measurement"])
                median = float(row["median_us"])
                best[key] = min(best.get(key, median), median)
                body[row["case"]] = int(row["body_bytes"])
    if not best:
        print("no results", file=sys.stderr)
        return 1
    runs = sorted({(v, e) for v, e, _, _ in best}, key=lambda r: (r[1] != "native", r))
    measurements = ["analyze", "pieces", "route", "limit"]
    for case in body:
        print(f"{case} (body {body[case]:,} B): best median per request, µs (MB/s of body)")
        print()
        print("| variant | engine | rounds | " + " | ".join(measurements) + " |")
        print("|---|---|---:|" + "---:|" * len(measurements))
        for v, e in runs:
            cells = []
            for m in measurements:
                t = best.get((v, e, case, m))
                cells.append("–" if t is None else f"{t:,.0f} ({body[case] / t:,.0f})")
            print(f"| {v} | {e} | {rounds[(v, e)]} | " + " | ".join(cells) + " |")
        print()
    sizes = out / "wasm-sizes.tsv"
    if sizes.exists():
        print("| variant | filter mmrouter.wasm | benchmark program |")
        print("|---|---:|---:|")
        for row in csv.reader(sizes.open(), delimiter="\t"):
            if len(row) == 3:
                print(f"| {row[0]} | {int(row[1]):,} B | {int(row[2]):,} B |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
