"""GPU suite: bandwidth and the decode floor, decode steps with CUDA graphs and eager, offline
throughput vs transformers, online P99s: the entry point of the `gpu` package beside this file.

    python benchmarks/gpu_suite.py --out gpu.json
    python benchmarks/gpu_suite.py --device cpu --model dummy:tiny --quick --out /tmp/smoke.json
"""

import sys

from gpu.cli import main

if __name__ == "__main__":
    sys.exit(main())
