"""``python -m monitor_agent.worker``: run one engine worker (see ``process.main``)."""

import logging
import os
import sys

from monitor_agent.worker.process import main

code = main()
# Everything is stopped and logged by now; skip the interpreter's teardown of torch's
# modules and thread pools (about half a second, while the agent waits for the exit).
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
