"""The node agent: device discovery and monitoring, worker supervision, AgentService.

``python -m monitor_agent`` runs the agent; ``python -m monitor_agent.worker`` is one
engine worker process (started by the agent). Only the worker side imports torch, so the
agent itself starts in well under a second.
"""
