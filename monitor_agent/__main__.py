"""``python -m monitor_agent``: run this node's agent (see ``monitor_agent.agent``)."""

import sys

from monitor_agent.agent import main

sys.exit(main())
