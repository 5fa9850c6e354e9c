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
