"""A channel plugin's `[plugins.routing] workspace` (seed 000's plugins.toml) is the workspace of the
conversations it serves: their turns' workspace tools, the sandbox and its /sandbox description, a working
directory set in one, and code context see that directory, not UGENT_WORKSPACE. Web conversations, and a
plugin that names none, keep UGENT_WORKSPACE."""
from __future__ import annotations

import pytest

from channels_app import sandbox
from channels_app.models import Conversation, ToolCall
from channels_app.services import channel_actor_resolve, conversation_resolve
from plugins_app.channel import services
from plugins_app.channel.models import Plugin
from plugins_app.channel.sdk import InboundMessage
from tests.plugins_app.conftest import make_plugin
from tests.support.toolboxes import tools_toml  # noqa: F401 - a fixture

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def places(tmp_path, settings, tools_toml):
    tools_toml('[tools]\nenabled = ["workspace"]\n')
    shared, team = tmp_path / "shared", tmp_path / "team-a"
    for folder, name in ((shared, "shared-only.txt"), (team, "team-only.txt")):
        folder.mkdir()
        (folder / name).write_text("hello\n")
    settings.UGENT_WORKSPACE = str(shared)
    return shared, team


def listed(plugin_id: str, message_id: str) -> list[str]:
    msg = InboundMessage(channel="echo", conversation_id="chat-1", message_id=message_id, sender_id="42",
                         text="script:call=workspace_list{}|result", source_type="user")
    result = services.inbound_submit(plugin_id=plugin_id, message=msg)
    assert result["accepted"], result
    call = ToolCall.objects.filter(turn__turn_id=result["turn_id"]).get()
    assert call.state == "done", call.error
    return sorted(entry["name"] for entry in call.result["entries"])


def test_a_plugins_turns_list_its_workspace_and_the_others_the_shared_one(tcast, places):
    shared, team = places
    make_plugin("echo-team", workspace=str(team))
    make_plugin("echo-plain")
    assert listed("echo-team", "m1") == ["team-only.txt"]
    assert listed("echo-plain", "m2") == ["shared-only.txt"]


def test_a_relative_workspace_is_taken_from_ugent_workspace_and_an_edit_counts_at_the_next_turn(tcast, places):
    shared, team = places
    (shared / "sub").mkdir()
    (shared / "sub" / "sub-only.txt").write_text("x\n")
    make_plugin("echo-team", workspace="sub")
    assert listed("echo-team", "m1") == ["sub-only.txt"]
    Plugin.objects.filter(plugin_id="echo-team").update(workspace=str(team))  # the admin's edit
    assert listed("echo-team", "m2") == ["team-only.txt"]


def test_the_sandbox_and_a_working_directory_are_the_plugins_and_a_web_conversation_keeps_the_shared(tcast, places):
    shared, team = places
    (team / "src").mkdir()
    make_plugin("echo-team", workspace=str(team))
    actor = channel_actor_resolve(channel="echo", user_id="42")
    conv, _ = conversation_resolve(channel="echo", client_id="echo-team", external_id="chat-1", actor=actor,
                                   caller=None)
    assert sandbox.sandbox_describe(conversation=conv)["workspace_root"] == str(team.resolve())
    assert sandbox.conversation_directory_set(conversation=conv, directory="src")["path"] == str(team / "src")
    with pytest.raises(Exception) as refused:  # the shared workspace is outside this conversation's
        sandbox.conversation_directory_set(conversation=Conversation.objects.get(pk=conv.pk), directory=str(shared))
    assert getattr(refused.value, "status", None) == 400
    assert sandbox.directory_confined(Conversation.objects.get(pk=conv.pk)) == (team / "src").resolve()
    listed_all = sandbox.sandbox_describe(every_conversation=True)["working_directories"]  # the operator's view
    assert [(d["client_id"], d["path"]) for d in listed_all] == [("echo-team", str(team / "src"))]

    web_actor = channel_actor_resolve(channel="web", user_id="alice")
    web, _ = conversation_resolve(channel="web", client_id="echo-team", external_id="w-1", actor=web_actor,
                                  caller=None)  # a web client_id that happens to be a plugin's id gets nothing
    assert sandbox.workspace_root(web) == shared.resolve()
