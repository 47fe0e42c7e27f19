"""``python -m jaxpm_halos.demo``."""

import sys

from .cli import main

sys.exit(main())
