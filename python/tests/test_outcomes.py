"""kvferry.Verdict / Action / Release: enums that are still the strings kvferry returns."""

import pytest

import kvferry
from kvferry import Action, Release, ReleaseReason, Verdict


def test_members_are_the_strings_returned_before():
    assert [v.value for v in Verdict] == ["verified", "mismatch", "unverified"]
    assert [a.value for a in Action] == ["complete", "fail", "recompute"]
    assert Verdict.UNVERIFIED == "unverified" and "recompute" == Action.RECOMPUTE
    assert {"served": 1}[Release.SERVED] == 1  # hashes as the string
    assert Verdict("mismatch") is Verdict.MISMATCH


def test_str_and_format_are_the_value():
    # Python 3.12 formats a (str, Enum) mixin as "Verdict.VERIFIED"; log lines and reasons must
    # keep the plain word.
    assert str(Verdict.VERIFIED) == "verified"
    assert f"{Action.FAIL}" == "fail" and "%s" % Release.EXPIRED == "expired"


def test_release_reasons_are_typed_and_print_as_before():
    served = ReleaseReason(Release.SERVED)
    assert served.kind is Release.SERVED and served.why is None
    assert ReleaseReason("expired").kind is Release.EXPIRED  # the binding passes the value
    failed = ReleaseReason.failed("publish on unit 1: x")
    assert failed.kind is Release.FAILED and failed.why == "publish on unit 1: x"
    assert failed == ReleaseReason(Release.FAILED, "publish on unit 1: x")
    # Log lines keep the words they had when reasons were strings.
    assert (str(served), str(ReleaseReason(Release.EXPIRED))) == ("served", "expired")
    assert str(failed) == "failed: publish on unit 1: x"


def test_a_release_reason_takes_a_why_only_when_failed():
    with pytest.raises(ValueError):
        ReleaseReason(Release.FAILED)
    with pytest.raises(ValueError):
        ReleaseReason(Release.SERVED, "why")
    with pytest.raises(ValueError):
        ReleaseReason("something new")  # an unknown kind is never taken for served


def test_the_policy_and_verdict_strings_convert():
    kc = kvferry.checksum
    policy = kc.KVChecksumPolicy(fail_closed=True, load_failure_policy="recompute")
    assert Action(policy.on_load_error()) is Action.RECOMPUTE
    got = kc.KVChecksumPayload(40, [kc.KVChecksumGroup(0, [11, 22, 33], block_size=16, fingerprint=7)])
    v = kc.compare(None, got)
    assert Verdict(v.status) is Verdict.UNVERIFIED
    assert Action(policy.decide(v)) is Action.RECOMPUTE  # fail-closed: the load failure policy
