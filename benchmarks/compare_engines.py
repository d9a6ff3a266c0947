"""Side-by-side comparison of tailserve with vLLM's CPU engine, llama.cpp and `transformers serve`:
the entry point of the `compare` package beside this file (see benchmarks/compare/cli.py).

    .venv/bin/python benchmarks/compare_engines.py --quick
"""

import sys

from compare.cli import main

if __name__ == "__main__":
    sys.exit(main())
