"""``python -m monitor_agent.worker``: run one engine worker (see ``process.main``)."""

import sys

from monitor_agent.worker.process import main

sys.exit(main())
