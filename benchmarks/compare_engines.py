"""tailserve against vLLM's CPU engine, llama.cpp and `transformers serve --continuous-batching`, with
a P99 interval behind every verdict: the entry point of the `compare` package beside this file
(flags and phases in benchmarks/compare/cli.py; how to run it in docs/COMPARE.md).

    .venv/bin/python benchmarks/compare_engines.py --quick
    .venv/bin/python benchmarks/compare_engines.py fast-path --quick   # one stream and 16, prefill, cold start
"""

import sys

from compare.cli import main

if __name__ == "__main__":
    sys.exit(main())
