"""The peers of the trickle comparison (bench/measure_trickle.py): each one
set up as its documentation recommends for a Django project, with the same
handler (``handler.sink``: one ORM insert into ``bench_sink``), two
handlings per event on the hot path, idle task types and periodic jobs
beside them where the peer has them. Each module is what that peer's own
worker process imports; nothing here imports django_platformkit."""
