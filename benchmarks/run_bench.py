"""Run the benchmark suite without the package's command line: same options as
``python -m distmoe bench`` (``--help`` lists them).

    PYTHONPATH=src python benchmarks/run_bench.py --out out/bench
"""

import sys

from distmoe.tools.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
