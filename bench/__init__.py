"""The benchmark suite (``python -m bench``): our publish, relay, consumer,
latency and memory measured against the floors of this machine (bare ORM
inserts, a raw JetStream publish loop) and against procrastinate and
pgqueuer, in one run, so the ratios hold however busy the machine is.
Not collected by pytest (``testpaths = ["tests"]``); see bench/README.md.
"""
