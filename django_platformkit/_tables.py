"""Table names, defined once (DESIGN.md "Tables"): the models use them for
``Meta.db_table`` and the hot-path SQL names them through these constants."""

OUTBOX_TABLE = "platformkit_outbox"
HANDLED_TABLE = "platformkit_handled"
DEAD_LETTER_TABLE = "platformkit_dead_letters"
JOBS_TABLE = "platformkit_jobs"
ATTEMPTS_TABLE = "platformkit_attempts"
IDENTITY_TABLE = "platformkit_identity"
WORKERS_TABLE = "platformkit_workers"
TASK_RESULTS_TABLE = "platformkit_task_results"
RATE_LIMITS_TABLE = "platformkit_rate_limits"
SUBSCRIPTIONS_TABLE = "platformkit_subscriptions"
PAUSES_TABLE = "platformkit_pauses"
JOB_CONTROLS_TABLE = "platformkit_job_controls"

#: The relay's backlog as operators read it (metrics, the admin overview):
#: ``(rows, seconds the oldest has been due)`` over rows the relay may send
#: now. A task deferred with ``run_after`` is not lag until its time comes,
#: and then it is due from its ``not_before``, not from when it was written.
#: Each branch walks its own partial index (pending plain rows; deferred rows
#: by due time), so a million rows due tomorrow cost nothing here.
DUE_BACKLOG_SQL = (
    "SELECT count(*), COALESCE(EXTRACT(EPOCH FROM clock_timestamp() - min(due_at)), 0) FROM ("
    f"SELECT created_at AS due_at FROM {OUTBOX_TABLE} WHERE published_at IS NULL AND not_before IS NULL "
    f"UNION ALL SELECT not_before FROM {OUTBOX_TABLE} WHERE published_at IS NULL AND not_before IS NOT NULL AND not_before <= now()"
    ") due"
)
