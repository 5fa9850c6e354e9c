"""The worker process: relay, consumer pool and scheduler over one broker
connection, the supervisor of ``runworker --processes``, and how a process
shows it is alive (health file, heartbeat, metrics)."""
