"""Print a memprobe log (see sitecustomize.py here) as a table in MiB, and its growth over a span.

.venv/bin/python benchmarks/memprobe/summary.py bench-results/X/mem.jsonl [--from S] [--to S]
"""

from __future__ import annotations

import argparse
import json

FIELDS = ("rss", "heap_in_use", "heap_free_kept", "mmapped", "py_traced")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("log")
    parser.add_argument(
        "--from", dest="start", type=float, default=0.0, help="span start, s since the server started"
    )
    parser.add_argument("--to", dest="end", type=float, default=float("inf"), help="span end, s")
    args = parser.parse_args()
    with open(args.log) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    present = [k for k in FIELDS if any(k in r for r in rows)]
    print("t_s  " + "  ".join(f"{k:>14}" for k in present))
    for r in rows:
        print(f"{r['t']:>5.0f}" + "".join(f"  {r.get(k, 0) / 2**20:>14.0f}" for k in present))
    span = [r for r in rows if args.start <= r["t"] <= args.end]
    if len(span) >= 2:
        first, last = span[0], span[-1]
        print(f"growth {first['t']:.0f} -> {last['t']:.0f} s (MiB): " + ", ".join(
            f"{k} {(last.get(k, 0) - first.get(k, 0)) / 2**20:+.0f}" for k in present
        ))  # fmt: skip


if __name__ == "__main__":
    main()
