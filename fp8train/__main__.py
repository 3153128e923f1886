"""`python -m fp8train ...` is the `fp8train` command."""

import sys

from .cli import main

sys.exit(main())
