"""`python -m compare` from benchmarks/ (same as `python benchmarks/compare_engines.py`)."""

import sys

from compare.cli import main

sys.exit(main())
