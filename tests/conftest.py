"""The shared cast: an operator, an application caller, two end users, an outsider."""
from __future__ import annotations

import pytest

from plugins_app.engines.registry import register_engine, reset as reset_engines
from tests.support.scripted import ScriptedEngine

register_engine("scripted", ScriptedEngine)

OPERATOR_KEY = "ugk_test_operator"
APP_KEY = "ugk_test_crm"
OUTSIDER_KEY = "ugk_test_outsider"


@pytest.fixture(autouse=True)
def _eager_celery():
    from ugent_site.celery import app
    app.conf.task_always_eager = True
    yield
    app.conf.task_always_eager = False


@pytest.fixture(autouse=True)
def _fresh_engines():
    yield
    reset_engines()


class Cast:
    def __init__(self):
        from channels_app.models import ApiKey, Caller
        from plugins_app.models import AgentProfile
        self.operator = Caller.objects.create(name="workspace", role="operator")
        self.app = Caller.objects.create(name="crm", role="application", issuers=["example-crm"])
        self.outsider = Caller.objects.create(name="other-app", role="application", issuers=["elsewhere"])
        for caller, raw in ((self.operator, OPERATOR_KEY), (self.app, APP_KEY), (self.outsider, OUTSIDER_KEY)):
            key = ApiKey(caller=caller)
            key.set_key(raw)
            key.save()
        self.profile = AgentProfile.objects.create(name="scripted", provider="scripted", is_default=True)
        self.keys = {"operator": OPERATOR_KEY, "app": APP_KEY, "outsider": OUTSIDER_KEY}
        # the two end users: named by the operator, and federated through the application
        self.alice = {"key": OPERATOR_KEY, "user": "alice"}
        self.bob = {"key": OPERATOR_KEY, "user": "bob"}
        self.carol = {"key": APP_KEY, "federation_issuer": "example-crm", "federation_subject": "carol"}


@pytest.fixture
def cast(db):
    return Cast()


@pytest.fixture
def tcast(transactional_db):
    return Cast()
