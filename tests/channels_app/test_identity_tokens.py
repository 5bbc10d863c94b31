"""JWTs from a listed issuer name the end user: verified against a real JWKS on loopback, or refused
with the rule that refused them (channels_app.federation)."""
from __future__ import annotations

import json
import threading

import pytest
from django.test import Client

from channels_app import federation
from channels_app.models import Conversation, Issuer, Message, Receipt, Turn
from tests.conftest import APP_KEY, OPERATOR_KEY, OUTSIDER_KEY
from tests.support import idp

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def keys():
    return {"rsa": idp.SigningKey("rsa"), "ec": idp.SigningKey("ec")}


@pytest.fixture
def jwks(keys):
    server = idp.JwksServer(keys["rsa"], keys["ec"])
    yield server
    server.close()


@pytest.fixture
def issuer(tcast, jwks, settings):
    federation.jwks_reset()
    settings.UGENT_JWKS_MIN_REFRESH_SECS = 3600  # one fetch per test unless a test says otherwise
    settings.UGENT_JWKS_TIMEOUT_SECS = 5
    yield Issuer.objects.create(issuer=idp.ISSUER, jwks_url=jwks.url, audience=idp.AUDIENCE,
                                actor_prefix=idp.PREFIX, algorithms=["RS256", "ES256"], leeway_secs=30)
    federation.jwks_reset()


def chat(key, token=None, *, header="bearer", **extra):
    body = {"messages": [{"role": "user", "content": "hi"}], **extra}
    headers = {"HTTP_X_API_KEY": key}
    if token is not None:
        if header == "bearer":
            headers["HTTP_AUTHORIZATION"] = f"Bearer {token}"
        else:
            headers["HTTP_X_UGENT_IDENTITY"] = token
    return Client().post("/v1/chat/completions", data=json.dumps(body), content_type="application/json",
                         **headers)


def counts():
    return [m.objects.count() for m in (Conversation, Receipt, Turn, Message)]


def test_an_rs256_token_acts_for_prefix_and_subject_and_overrides_the_body(issuer, keys):
    token = idp.sign(keys["rsa"], idp.claims("carol"))
    resp = chat(APP_KEY, token, conversation_id="c1", federation_issuer=idp.ISSUER, federation_subject="mallory")
    assert resp.status_code == 200, resp.content
    turn = Turn.objects.get()
    assert turn.actor.key == "crm:carol"
    assert (turn.actor.federation_issuer, turn.actor.federation_subject) == (idp.ISSUER, "carol")


def test_an_es256_token_in_the_identity_header_is_verified_too(issuer, keys):
    token = idp.sign(keys["ec"], idp.claims("dave"))
    assert chat(APP_KEY, token, header="x-ugent-identity", conversation_id="c2").status_code == 200
    assert Turn.objects.get().actor.key == "crm:dave"


def test_an_operator_key_with_a_token_acts_for_the_tokens_user(issuer, keys):
    token = idp.sign(keys["rsa"], idp.claims("erin"))
    assert chat(OPERATOR_KEY, token, user="alice", conversation_id="c3").status_code == 200
    assert Turn.objects.get().actor.key == "crm:erin"


def test_an_application_may_carry_tokens_only_of_the_issuers_it_lists(issuer, keys):
    token = idp.sign(keys["rsa"], idp.claims("carol"))
    before = counts()
    resp = chat(OUTSIDER_KEY, token, conversation_id="c4")
    assert resp.status_code == 403
    assert resp.json()["error"]["message"] == (
        "An application key may name only federated users of the issuers it lists: the identity token's "
        "issuer 'example-crm' is not one of them.")
    assert counts() == before


def _forged(keys, kind):
    rsa = keys["rsa"]
    stranger = idp.SigningKey("rsa", kid="not-in-the-jwks")
    return {
        "expired": (idp.sign(rsa, idp.claims(exp_in=-3600)), "it has expired (exp)."),
        "not yet valid": (idp.sign(rsa, idp.claims(nbf_in=3600)), "it is not valid yet (nbf or iat in the future)."),
        "another audience": (idp.sign(rsa, idp.claims(aud="someone-else")),
                             "its audience (aud) is not 'ugent-test'."),
        "unlisted issuer": (idp.sign(rsa, idp.claims(iss="https://evil.example")),
                            "its issuer 'https://evil.example' is not listed in [[web.auth.issuers]]."),
        "unknown key": (idp.sign(stranger, idp.claims()),
                        "it is signed by a key (kid 'not-in-the-jwks') that the JWKS of issuer 'example-crm' "
                        "does not hold."),
        "alg none": (idp.unsigned(idp.claims()), "its algorithm is none: an unsigned token is never accepted."),
        "hs256 with the public key": (idp.hs256_with_public_key(rsa, idp.claims()),
                                      "its algorithm HS256 is not allowed for issuer 'example-crm' "
                                      "(allowed: RS256, ES256)."),
        "no exp": (idp.sign(rsa, idp.claims(exp_in=None)), "it lacks the exp claim."),
        "wrong signature": (idp.sign(stranger, idp.claims(), kid=rsa.kid),
                            "its signature does not verify against the issuer's key."),
        "key of another type": (idp.sign(keys["ec"], idp.claims(), kid=rsa.kid),
                                f"its algorithm ES256 does not match the RSA key (kid {rsa.kid!r}) it names."),
        "not a jwt": ("definitely-not-a-jwt",
                      "it is not a JWT (three base64url parts: header, claims, signature)."),
    }[kind]


@pytest.mark.parametrize("kind", ["expired", "not yet valid", "another audience", "unlisted issuer", "unknown key",
                                  "alg none", "hs256 with the public key", "no exp", "wrong signature",
                                  "key of another type", "not a jwt"])
def test_a_bad_token_is_refused_with_its_reason_and_runs_nothing(issuer, keys, kind):
    token, reason = _forged(keys, kind)
    before = counts()
    resp = chat(APP_KEY, token, conversation_id="bad", federation_issuer=idp.ISSUER, federation_subject="carol")
    assert resp.status_code == 403, resp.content
    err = resp.json()["error"]
    assert err["message"] == "The identity token was refused: " + reason
    assert err["code"] == "identity_token_invalid"
    assert counts() == before


def test_the_hs256_confusion_token_is_refused_even_when_the_issuer_would_allow_hmac(issuer, keys):
    # the admin and ugent.toml refuse HS* outright; a row written around them is still never honoured
    Issuer.objects.filter(pk=issuer.pk).update(algorithms=["HS256", "RS256"])
    resp = chat(APP_KEY, idp.hs256_with_public_key(keys["rsa"], idp.claims()), conversation_id="hs")
    assert resp.status_code == 403 and "HS256 is not allowed" in resp.json()["error"]["message"]
    assert not Turn.objects.exists()


def test_the_leeway_forgives_a_little_clock_skew_and_no_more(issuer, keys):
    just_expired = idp.sign(keys["rsa"], idp.claims("carol", exp_in=-5))
    assert chat(APP_KEY, just_expired, conversation_id="l1").status_code == 200
    Issuer.objects.filter(pk=issuer.pk).update(leeway_secs=0)
    assert chat(APP_KEY, just_expired, conversation_id="l2").status_code == 403


def test_the_jwks_is_cached_by_its_cache_control(issuer, keys, jwks):
    for i in range(3):
        assert chat(APP_KEY, idp.sign(keys["rsa"], idp.claims("carol")), conversation_id=f"k{i}").status_code == 200
    assert jwks.hits == 1


def test_a_stale_jwks_is_fetched_again(issuer, keys, jwks, settings):
    jwks.cache_control = "max-age=0"
    settings.UGENT_JWKS_MIN_REFRESH_SECS = 0
    for i in range(2):
        assert chat(APP_KEY, idp.sign(keys["rsa"], idp.claims("carol")), conversation_id=f"s{i}").status_code == 200
    assert jwks.hits == 2


def test_a_key_rotated_at_the_jwks_is_picked_up_on_the_next_unknown_kid(issuer, keys, jwks, settings):
    settings.UGENT_JWKS_MIN_REFRESH_SECS = 0
    assert chat(APP_KEY, idp.sign(keys["rsa"], idp.claims("carol")), conversation_id="r1").status_code == 200
    rotated = idp.SigningKey("rsa")
    jwks.keys = [rotated]  # the provider rotates: the old key is gone, a new kid is served
    assert jwks.hits == 1
    assert chat(APP_KEY, idp.sign(rotated, idp.claims("carol")), conversation_id="r2").status_code == 200
    assert jwks.hits == 2
    old = chat(APP_KEY, idp.sign(keys["rsa"], idp.claims("carol")), conversation_id="r3")
    assert old.status_code == 403 and "does not hold" in old.json()["error"]["message"]


def test_unknown_kids_fetch_the_jwks_at_most_once_per_interval(issuer, keys, jwks, settings):
    assert chat(APP_KEY, idp.sign(keys["rsa"], idp.claims()), conversation_id="i1").status_code == 200
    rotated = idp.SigningKey("rsa")
    jwks.keys = [rotated]
    for i in range(3):  # within the interval: refused without asking the provider again
        resp = chat(APP_KEY, idp.sign(rotated, idp.claims()), conversation_id=f"i2{i}")
        assert resp.status_code == 403
    assert jwks.hits == 1
    settings.UGENT_JWKS_MIN_REFRESH_SECS = 0  # the interval has passed
    assert chat(APP_KEY, idp.sign(rotated, idp.claims()), conversation_id="i3").status_code == 200
    assert jwks.hits == 2


def test_a_jwks_that_is_down_refuses_tokens_with_the_reason_and_keeps_the_keys_it_held(issuer, keys, jwks, settings):
    jwks.status = 503
    resp = chat(APP_KEY, idp.sign(keys["rsa"], idp.claims()), conversation_id="d1")
    assert resp.status_code == 403
    assert resp.json()["error"]["message"] == (
        "The identity token was refused: the JWKS of issuer 'example-crm' could not be fetched, so no token "
        "of it can be verified now.")
    assert chat(APP_KEY, conversation_id="d2").status_code == 200  # a request without a token is unaffected
    jwks.status = 200
    settings.UGENT_JWKS_MIN_REFRESH_SECS = 0
    jwks.cache_control = "max-age=0"
    assert chat(APP_KEY, idp.sign(keys["rsa"], idp.claims()), conversation_id="d3").status_code == 200
    jwks.status = 503  # down again: the stale keys still verify
    assert chat(APP_KEY, idp.sign(keys["rsa"], idp.claims()), conversation_id="d4").status_code == 200


def test_a_hanging_jwks_does_not_stall_requests_that_carry_no_token(issuer, keys, jwks):
    jwks.hold()
    results = {}

    def with_token():
        results["token"] = chat(APP_KEY, idp.sign(keys["rsa"], idp.claims("carol")), conversation_id="h1").status_code

    t = threading.Thread(target=with_token)
    t.start()
    try:
        assert jwks.waiting.wait(30), "the token request never reached the JWKS"
        # the provider still holds the token's request: a request without a token is answered meanwhile
        assert chat(APP_KEY, conversation_id="h2").status_code == 200
        assert chat(OPERATOR_KEY, user="alice", conversation_id="h3").status_code == 200
        assert "token" not in results
    finally:
        jwks.release()
        t.join(30)
    assert results["token"] == 200


@pytest.mark.parametrize("length,status", [(255, 200), (256, 403)])
def test_a_subject_longer_than_the_rows_keep_is_refused_not_a_500(issuer, keys, length, status):
    """A verified sub is the user's id as kept (255 characters): a longer one is refused as a token, with
    nothing written; it was a DataError (500) on PostgreSQL where the actor's row is first saved."""
    token = idp.sign(keys["rsa"], idp.claims("s" * length))
    before = counts()
    resp = chat(APP_KEY, token, conversation_id="c-long")
    assert resp.status_code == status, resp.content
    if status != 200:
        assert resp.json()["error"]["code"] == "identity_token_invalid"
        assert "its subject (sub) is empty or too long." in resp.json()["error"]["message"]
        assert counts() == before
