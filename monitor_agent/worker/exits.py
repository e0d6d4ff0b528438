"""A worker's exit codes: what ``python -m monitor_agent.worker`` returns, and what the
agent's supervisor reads when it reaps one (kept apart from the worker's process module so
the agent can read them without importing it)."""

from __future__ import annotations

EXIT_ENGINE_FAILED = 1
EXIT_BAD_ARGUMENTS = 2
# Another rank of the group died, so this one stopped: a consequence, never the cause.
EXIT_GROUP_LOST = 3
