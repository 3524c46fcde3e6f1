"""``python -m jaxrat.checkpoints WORKDIR [--json]``: list a run's checkpoints (see jaxrat.checkpointing.inspect)."""

import sys

from jaxrat.checkpointing.inspect import main

if __name__ == "__main__":
    sys.exit(main())
