"""The gate proves itself on the canary: now `evalgate selfcheck` (evalgate/cli/selfcheck.py); this caller
keeps the old command line:

    python benchmarks/canary_selfcheck.py [--kernels ...] [--runs-dir DIR] [--json FILE]
"""

from __future__ import annotations

import sys

from evalgate.cli.main import main

if __name__ == "__main__":
    main(["selfcheck", *sys.argv[1:]], prog_name="evalgate")
