"""Which database instance holds a stream (``identity.judge``), decided
without a broker or a database: the holder renews its tenure, a copy with
the same identity is refused and makes the holder 'contested', a holder
gone quiet for however long is never taken over by itself (only
``stream takeover`` moves it), another identity is foreign."""

from __future__ import annotations

import pytest

from django_platformkit import identity
from django_platformkit.identity import LIVE_SECONDS, RENEW_SECONDS, Standing, Tenure, judge

pytestmark = pytest.mark.unit

OURS = "6c1c3a5e-0000-4000-8000-000000000001"
PROD, STAGING = "7715080729396114268:16384", "7715080729396114268:24576"


def decide(recorded: Tenure, instance: str | None, now: float):
    return judge(recorded, OURS, instance, now=now, stream="S", url="nats://h:4222")


def test_a_stream_without_a_recorded_instance_is_recorded_as_ours():
    for recorded in (Tenure(None), Tenure(OURS)):
        verdict = decide(recorded, PROD, 1000.0)
        assert verdict.standing is Standing.OWNER and verdict.tenure == Tenure(OURS, PROD, 1000.0)


def test_the_holder_renews_its_tenure_once_it_is_renew_seconds_old():
    recorded = Tenure(OURS, PROD, 1000.0)
    assert decide(recorded, PROD, 1000.0 + RENEW_SECONDS - 1).tenure is None  # nothing to write yet
    renewed = decide(recorded, PROD, 1000.0 + RENEW_SECONDS)
    assert renewed.standing is Standing.OWNER and renewed.tenure == Tenure(OURS, PROD, 1000.0 + RENEW_SECONDS)


def test_a_live_copy_is_refused_with_the_fix_and_recorded_so_the_holder_is_contested():
    recorded = Tenure(OURS, PROD, 1000.0)
    copy = decide(recorded, STAGING, 1010.0)
    assert copy.standing is Standing.COPY and copy.refused
    assert copy.tenure == Tenure(OURS, PROD, 1000.0, STAGING, 1010.0)  # the holder stays, the copy is noted
    assert "UPDATE platformkit_identity SET database_id = gen_random_uuid()" in copy.text
    assert "PLATFORMKIT['STREAM']" in copy.text and PROD in copy.text and STAGING in copy.text
    assert "seen 10 s ago (its workers are running)" in copy.text
    holder = decide(copy.tenure, PROD, 1020.0)
    assert holder.standing is Standing.CONTESTED and not holder.refused
    assert STAGING in holder.text and "handed back, not terminated" in holder.text
    # Once the copy stopped trying for LIVE_SECONDS, the holder is a plain owner again.
    assert decide(copy.tenure, PROD, 1010.0 + LIVE_SECONDS).standing is Standing.OWNER


def test_a_holder_silent_for_however_long_is_never_taken_over_by_itself():
    # A staging copy started while production was down for 2 minutes took the stream over and
    # handled production's events in the staging database (issue 32).
    recorded = Tenure(OURS, PROD, 1000.0)
    for silent in (LIVE_SECONDS, 10 * LIVE_SECONDS, 30 * 86400.0):
        verdict = decide(recorded, STAGING, 1000.0 + silent)
        assert verdict.standing is Standing.COPY and verdict.refused
        assert verdict.tenure == Tenure(OURS, PROD, 1000.0, STAGING, 1000.0 + silent)  # the holder stays
        assert f"instance {PROD}, not seen for {silent:.0f} s" in verdict.text
        assert f"This database is instance {STAGING} and does not hold it" in verdict.text
        assert "`manage.py stream takeover --yes`" in verdict.text
        assert "UPDATE platformkit_identity SET database_id = gen_random_uuid()" in verdict.text
    # The holder, back, is the owner (contested while the copy's attempt is recent), and says which side is which.
    back = decide(Tenure(OURS, PROD, 1000.0, STAGING, 2000.0), PROD, 2010.0)
    assert back.standing is Standing.CONTESTED and not back.refused
    assert f"This database, instance {PROD}, holds it" in back.text and f"instance {STAGING}" in back.text
    assert "`manage.py stream takeover --yes`" in back.text


def test_a_takeover_records_the_new_holder_without_a_contender_and_never_across_identities():
    recorded = Tenure(OURS, PROD, 1000.0, STAGING, 1010.0)
    assert identity.takeover_tenure(recorded, OURS, STAGING, 5000.0) == Tenure(OURS, STAGING, 5000.0)
    assert decide(Tenure(OURS, STAGING, 5000.0), STAGING, 5001.0).standing is Standing.OWNER
    assert decide(Tenure(OURS, STAGING, 5000.0), PROD, 5002.0).standing is Standing.COPY  # the old holder now
    with pytest.raises(ValueError, match="belongs to database 11111111"):
        identity.takeover_tenure(Tenure("11111111-1111-4111-8111-111111111111", PROD, 0.0), OURS, STAGING, 1.0)


def test_another_identity_is_foreign_whatever_the_instance():
    verdict = judge(Tenure("11111111-1111-4111-8111-111111111111", PROD, 0.0), OURS, PROD, now=0.0, stream="S", url="u")
    assert verdict.standing is Standing.FOREIGN and "manage.py stream reset --yes" in verdict.text
    assert "nats stream rm" not in verdict.text


def test_the_tenure_round_trips_through_the_stream_description():
    tenure = Tenure(OURS, PROD, 1000.0, STAGING, 1010.0)
    text = identity.describe(OURS, tenure)
    assert Tenure.read(text, None) == tenure
    assert identity.recorded_identity(text, None) == OURS
    # A description written before instances were recorded still names the identity.
    assert Tenure.read(identity.describe(OURS), None) == Tenure(OURS)
