"""Entry point of the served streaming benchmark: `python -m benchmarks.served_bench [--quick|--smoke] ...`.

The benchmark itself is the package benchmarks/served/ (what it measures: benchmarks/served/cli.py,
docs/performance.md).
"""

from benchmarks.served.cli import main

if __name__ == "__main__":
    main()
