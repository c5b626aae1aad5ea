"""``python -m distmoe.tools.bench``: the same suite as ``python -m distmoe bench``."""

from distmoe.tools.bench.cli import main

raise SystemExit(main())
