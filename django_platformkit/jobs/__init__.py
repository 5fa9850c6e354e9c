"""The clock side: periodic jobs declared with ``@job``, run once per slot
across every worker under a PostgreSQL advisory lock and a slot ledger."""
