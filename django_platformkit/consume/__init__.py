"""3. Consuming: a delivery becomes a claim and a handler run in one
transaction, then an ack, a retry after a backoff, or a dead letter with its
terminal claim - exactly once per (subscription, event)."""
