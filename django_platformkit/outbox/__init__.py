"""1. The outbox: rows in, rows out. ``publish()`` writes one row in the
caller's transaction; the relay moves pending rows to the broker and stamps
them only after the broker stored them, so nothing is lost between the two."""
