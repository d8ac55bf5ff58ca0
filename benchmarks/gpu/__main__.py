"""``python -m benchmarks.gpu``: the GPU check (see check.py)."""

from .check import main

raise SystemExit(main())
