"""One engine worker process: ``python -m monitor_agent.worker`` (see ``process``)."""
