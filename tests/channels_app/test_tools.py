"""The tool loop: a turn calls the tools its engine asks for, within the step limit and the per-tool
timeout, records each call, narrows what it offers, delegates, returns artifacts."""
from __future__ import annotations

import json
import time

import pytest
from django.test import Client

from channels_app.models import Event, Receipt, ToolCall, Turn
from channels_app import tools as hub_tools
from tests.support import scripted
from tests.support.http import answer_text, body_bytes, parse_sse
from tests.support.toolboxes import tools_toml  # noqa: F401 - a fixture

pytestmark = pytest.mark.django_db(transaction=True)
ENABLE = '[tools]\nenabled = ["testing", "workspace", "delegation"]\n'


def chat(who: dict, text: str, *, stream=False, **extra):
    body = {"messages": [{"role": "user", "content": text}], "stream": stream}
    body.update({k: v for k, v in who.items() if k != "key"})
    body.update(extra)
    return Client().post("/v1/chat/completions", data=json.dumps(body), content_type="application/json",
                         HTTP_X_API_KEY=who["key"])


def answer(resp) -> str:
    assert resp.status_code == 200, resp.content
    return resp.json()["choices"][0]["message"]["content"]


def offered() -> list[str]:
    return scripted.CALLS[-1]["tools"]


@pytest.fixture
def enabled(tools_toml):
    tools_toml(ENABLE)


def test_a_called_tool_runs_and_its_result_goes_back_to_the_engine(tcast, enabled):
    text = answer(chat(tcast.alice, 'script:answer=looking|call=echo{"text": "hi there"}|result|answer= done'))
    assert text == 'looking{"echo": "hi there"} done'
    call = ToolCall.objects.get()
    assert (call.name, call.arguments, call.state, call.result, call.error) == (
        "echo", {"text": "hi there"}, "done", {"echo": "hi there"}, "")
    assert call.ms is not None and call.ms >= 0 and call.toolbox == "testing"
    # the engine saw the assistant's call and the TOOL result on its second step
    roles = [r for r, _ in scripted.CALLS[-1]["messages"]]
    assert roles[-2:] == ["assistant", "tool"]
    deltas = [e.data["tool"] for e in Event.objects.filter(type="turn.delta", data__segment="tool").order_by("id")]
    assert [d["status"] for d in deltas] == ["running", "done"]
    assert deltas[1]["result"] == {"echo": "hi there"}


def test_parallel_calls_of_one_step_all_run(tcast, enabled):
    text = answer(chat(tcast.alice, 'script:call=echo{"text": "a"}|call=echo{"text": "b"}|result'))
    assert text == '{"echo": "a"}\n{"echo": "b"}'
    assert list(ToolCall.objects.values_list("step", flat=True)) == [0, 0]


def test_a_failing_or_unknown_tool_is_an_error_result_not_a_failed_turn(tcast, enabled):
    text = answer(chat(tcast.alice, 'script:call=boom|call=nosuch|call=echo{"wrong": 1}|result'))
    errors = [json.loads(line)["error"] for line in text.splitlines()]
    assert errors[0] == "the tool broke"
    assert errors[1] == "no tool named 'nosuch' is offered to this turn"
    assert errors[2].startswith("invalid arguments")
    assert list(ToolCall.objects.values_list("state", flat=True)) == ["error", "error", "error"]
    assert Turn.objects.get().state == "completed"


def test_the_step_limit_refuses_further_calls_and_takes_the_tools_away(tcast, enabled, settings):
    settings.UGENT_TOOL_STEP_LIMIT = 2
    text = answer(chat(tcast.alice, "script:call=noop|answer=a|call=echo{\"text\": \"x\"}|answer=a|"
                                    "call=noop|result|answer=b"))
    # steps 0 and 1 ran; the third step's call is refused, and the engine's last step had no tools
    calls = list(ToolCall.objects.values_list("step", "state", "error"))
    assert calls[:2] == [(0, "done", ""), (1, "done", "")]
    assert calls[2][0] == 2 and calls[2][1] == "error" and "step limit (2)" in calls[2][2]
    assert "step limit (2)" in text and text.endswith("b")
    assert scripted.CALLS[-1]["tools"] == []


def test_a_tool_past_its_timeout_is_cut_off_with_an_error(tcast, enabled, settings):
    settings.UGENT_TOOL_TIMEOUT_SECONDS = 0.3
    text = answer(chat(tcast.alice, 'script:call=sleep{"seconds": 5}|result'))
    assert json.loads(text)["error"] == "the tool did not answer within 0.3 s"
    call = ToolCall.objects.get()
    assert call.state == "error" and call.error == "the tool did not answer within 0.3 s"


def overrun_settled() -> None:
    deadline = time.monotonic() + 20
    while hub_tools.overrunning() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hub_tools.overrunning() == {}


def test_a_toolbox_whose_calls_hang_is_refused_at_once_while_others_go_on(tcast, enabled, settings):
    # Each call past its timeout keeps its thread; without a cap a hung toolbox piled them up without end.
    settings.UGENT_TOOL_TIMEOUT_SECONDS = 0.3
    settings.UGENT_TOOL_OVERRUN_MAX = 2
    overrun_settled()  # an earlier test's call may still be running past its own timeout
    text = answer(chat(tcast.alice, 'script:call=sleep{"seconds": 3}|call=sleep{"seconds": 3}|'
                                    'call=echo{"text": "x"}|call=workspace_list{}|result'))
    first, second, refused, other = [json.loads(line) for line in text.splitlines()]
    assert first["error"] == second["error"] == "the tool did not answer within 0.3 s"
    assert refused == {"error": "2 earlier calls of this toolbox are still running past their time limit: it is "
                                "not called again until they end (UGENT_TOOL_OVERRUN_MAX)"}
    assert "error" not in other  # another toolbox is called as before
    assert hub_tools.overrunning() == {"testing": 2}
    status = Client().get("/v1/ugent/status", HTTP_X_API_KEY=tcast.keys["operator"]).json()["status"]["tools"]
    assert status["overrunning"] == {"testing": 2} and status["overrun_max"] == 2
    overrun_settled()  # once the hung calls end, the toolbox is called again
    assert answer(chat(tcast.alice, 'script:call=echo{"text": "y"}|result', conversation_id="c-after")) == \
        '{"echo": "y"}'


def test_a_result_over_the_size_limit_is_an_error_stored_and_sent_nowhere(tcast, enabled, settings):
    # it would be stored in the row, streamed to every listener and sent to the model whole
    settings.UGENT_TOOL_RESULT_MAX_BYTES = 100
    text = answer(chat(tcast.alice, 'script:call=echo{"text": "' + "x" * 200 + '"}|call=echo{"text": "ok"}|result'))
    big, small = [json.loads(line) for line in text.splitlines()]
    assert big["error"] == ("the tool's result is 212 bytes, over the 100 a result may be "
                            "(UGENT_TOOL_RESULT_MAX_BYTES): ask for less of it")
    assert small == {"echo": "ok"}
    calls = list(ToolCall.objects.order_by("id").values_list("state", "result"))
    assert calls == [("error", None), ("done", {"echo": "ok"})]
    ends = [e.data["tool"] for e in Event.objects.filter(type="turn.delta", data__segment="tool").order_by("id")
            if e.data["tool"]["status"] != "running"]
    assert "result" not in ends[0] and ends[0]["status"] == "error" and ends[1]["result"] == {"echo": "ok"}


def test_artifacts_arrive_on_the_turn_the_receipt_and_the_stream(tcast, enabled):
    """More in tests/channels_app/test_artifacts.py: storing, downloading, finishing a pending one."""
    frames = parse_sse(body_bytes(chat(tcast.alice, "script:call=make_file|answer=made", stream=True)))
    named = {f["event"]: f["data"] for f in frames if f["event"]}
    [ready] = named["ugent.artifacts"]["ugent_artifacts"]
    assert (ready["name"], ready["mime"], ready["bytes"], ready["url"]) == (
        "report.txt", "text/plain", 5, f"/v1/files/{ready['id']}")
    assert [a["name"] for a in named["ugent.artifacts_pending"]["ugent_artifacts_pending"]] == ["report.txt",
                                                                                                "big.bin"]
    assert answer_text(frames) == "made"
    receipt = Receipt.objects.get()
    assert [f["name"] for f in receipt.files] == ["report.txt", "big.bin"]
    assert receipt.files[0] == ready and receipt.files[1]["pending"] is True
    assert Turn.objects.get().artifacts == receipt.files


def test_tool_events_stream_only_when_asked(tcast, enabled):
    def tool_deltas(frames):
        return [f["data"]["choices"][0]["delta"] for f in frames if f["event"] is None
                and isinstance(f["data"], dict) and f["data"].get("choices")
                and f["data"]["choices"][0]["delta"].get("ugent_segment") == "tool"]
    plain = parse_sse(body_bytes(chat(tcast.alice, "script:call=noop|answer=ok", stream=True)))
    assert tool_deltas(plain) == []
    frames = parse_sse(body_bytes(chat(tcast.bob, "script:call=noop|answer=ok", stream=True,
                                       ugent_include_tool_events=True)))
    tools = [d["ugent_tool"] for d in tool_deltas(frames)]
    assert [(t["name"], t["status"]) for t in tools] == [("noop", "running"), ("noop", "done")]


# --- narrowing ------------------------------------------------------------------------------------

ALL_TOOLS = ["noop", "echo", "sleep", "boom", "make_file", "file_at", "finish_pending", "link_file", "workspace_list", "workspace_read",
             "workspace_search", "delegate_research"]


def test_every_enabled_tool_is_offered_without_narrowing(tcast, enabled):
    answer(chat(tcast.alice, "hello"))
    assert offered() == ALL_TOOLS


ROUTING = '[[routes]]\nname = "r"\nmatch = { always = true }\nallowed_tools = ["noop", "echo", "sleep"]\n'


@pytest.mark.parametrize("routing, allowed, denied, caller, expected", [
    (False, None, None, None, ALL_TOOLS),
    (False, ["noop", "echo"], None, None, ["noop", "echo"]),
    (False, None, ["noop"], None, [t for t in ALL_TOOLS if t != "noop"]),
    (False, None, ["*"], None, []),
    (True, None, None, None, ["noop", "echo", "sleep"]),
    (True, ["echo", "boom"], None, None, ["echo"]),  # the request cannot widen routing's set
    (True, None, ["sleep"], None, ["noop", "echo"]),
    (False, None, None, {"allowed_tools": ["echo", "sleep"]}, ["echo", "sleep"]),
    (False, ["noop", "echo"], None, {"allowed_tools": ["echo", "sleep"]}, ["echo"]),
    (False, None, None, {"denied_tools": ["*"]}, []),
    (True, ["noop", "echo"], ["echo"], {"allowed_tools": ["noop", "sleep"]}, ["noop"]),
])
def test_the_narrowing_matrix(tcast, tools_toml, tmp_path, settings, routing, allowed, denied, caller, expected):
    from channels_app.models import CallerDefaults
    from rules_app.runtime import runtime
    settings.UGENT_WORKSPACE = str(tmp_path / "ws")
    settings.UGENT_HOME = str(tmp_path / "home")
    settings.UGENT_ROUTING_RECHECK_SECONDS = 0.0
    (tmp_path / "ws").mkdir()
    if routing:  # a home's routing.toml needs no workspace trust
        (tmp_path / "home" / ".ugent").mkdir(parents=True)
        (tmp_path / "home" / ".ugent" / "routing.toml").write_text(ROUTING)
    runtime.reset()
    tools_toml(ENABLE)
    if caller:
        CallerDefaults.objects.create(issuer="example-crm", **caller)
    extra = {}
    if allowed is not None:
        extra["ugent_allowed_tools"] = allowed
    if denied is not None:
        extra["ugent_denied_tools"] = denied
    try:
        answer(chat(tcast.carol, "hello", **extra))
        assert offered() == expected
    finally:
        runtime.reset()


# --- delegation carries the turn's narrowing --------------------------------------------------------

DELEGATE = 'script:call=delegate_research{"task": "script:call=noop"}|result'


@pytest.mark.parametrize("denied,sub_offered", [(None, True), (["noop"], False)])
def test_a_delegated_task_gets_the_turns_narrowing_never_more(tcast, enabled, denied, sub_offered):
    extra = {"ugent_denied_tools": denied} if denied else {}
    resp = chat(tcast.alice, DELEGATE, **extra)
    assert resp.status_code == 200, resp.content
    parent = ToolCall.objects.get(name="delegate_research")
    assert not parent.error, parent.error
    offered = parent.result["tools"]
    assert ("noop" in offered) is sub_offered and "echo" in offered
    assert "delegate_research" not in offered  # one level deep (UGENT_TOOL_DELEGATION_DEPTH)
    sub = ToolCall.objects.get(name="noop")
    assert sub.depth == 1
    assert bool(sub.error) is (not sub_offered)  # a call of a tool the task was not offered never runs
