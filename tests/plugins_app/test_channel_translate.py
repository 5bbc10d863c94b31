"""channel-translate end to end: the real supervisor runs the worker on a real inbox and outbox.

There is no platform to fake: the channel is two directories. The scripted engine answers a message
that is not a script with ``echo: <the message> (history=<n>)``, so each "translation" holds the
instruction and the chunk the engine was sent, and the number of earlier messages in the document's
conversation: enough to check that every chunk reached the engine once, in order, with the chunks
before it as context, and that the answers were put back in that order.
"""
from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from channels_app.models import Receipt, Turn
from plugins_app.channel.models import OutboundDelivery, Plugin
from plugins_app.channel.workers.translate.documents import parse_srt
from tests.plugins_app.conftest import make_plugin, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc and prctl")

PID = "translate-main"
HISTORY = re.compile(r"\(history=(\d+)\)")


class Pipeline:
    def __init__(self, root: Path):
        self.inbox = root / "inbox"
        self.outbox = root / "outbox"

    def drop(self, name: str, content: str | bytes) -> None:
        """Write under a temporary name, then rename: the drop an operator's tools make."""
        self.inbox.mkdir(parents=True, exist_ok=True)
        part = self.inbox / f"{name}.part"
        part.write_bytes(content.encode() if isinstance(content, str) else content)
        os.replace(part, self.inbox / name)

    def out(self, name: str) -> Path:
        return self.outbox / name

    def written(self, *names: str, timeout: float = 60) -> list[str]:
        assert wait_until(lambda: all(self.out(n).exists() for n in names), timeout), (
            names, sorted(p.name for p in self.outbox.glob("*")) if self.outbox.exists() else None)
        return [self.out(n).read_text() for n in names]

    def settled(self, name: str, where: str = "done", timeout: float = 60) -> bool:
        return wait_until(lambda: (self.inbox / where / name).exists() and not (self.inbox / name).exists(),
                          timeout)


@pytest.fixture
def pipe(short_dir):
    return Pipeline(short_dir / "pipe")


def translate_plugin(pipe: Pipeline, *args: str, to: str = "de,fr") -> Plugin:
    return make_plugin(PID, kind="channel-translate", command="",
                       args=["--inbox", str(pipe.inbox), "--outbox", str(pipe.outbox), "--to", to,
                             "--settle-secs", "0.3", "--max-chunk-chars", "200", *args],
                       env_refs=[], heartbeat_secs=1.0)


def paragraphs(n: int, tag: str) -> list[str]:
    return [f"{tag} paragraph {i} tells a story about item {i} in quite a few words." for i in range(n)]


def in_order(text: str, parts: list[str]) -> bool:
    """Each part occurs in ``text`` exactly once, in this order."""
    at = -1
    for part in parts:
        if text.count(part) != 1:
            return False
        found = text.find(part)
        if found < at:
            return False
        at = found
    return True


def saw_the_chunks_before(text: str, n: int) -> bool:
    """The n answers' engine calls each had the earlier chunks and answers of the document as history (up to
    the window the context manager keeps)."""
    history = [int(h) for h in HISTORY.findall(text)]
    return len(history) == n and history == [min(2 * i, max(history)) for i in range(n)] and history[1:2] == [2]


def answers_of(text: str) -> list[str]:
    return [a for a in re.split(r"(?=echo: )", text) if a.strip()]


def test_a_txt_an_md_and_an_srt_come_out_in_two_languages(tcast, pipe, start_runtime, short_dir):
    glossary = short_dir / "glossary.txt"
    glossary.write_text("# terms\nfilm = film\n[de]\nstory = Geschichte\n[fr]\nstory = histoire\n")
    translate_plugin(pipe, "--glossary", str(glossary))
    rt = start_runtime()
    txt = paragraphs(9, "Plain")
    md = ["# The guide", "Some *emphasis* and a [link](https://example.com/x).",
          "```\ncode stays\n\ncode\n```", *paragraphs(4, "Markdown")]
    srt = "".join(f"{i}\n00:00:{i:02d},000 --> 00:00:{i:02d},900\nLine {i} of the film.\n\n" for i in range(1, 13))
    pipe.drop("story.txt", "\n\n".join(txt) + "\n")
    pipe.drop("guide.md", "\n\n".join(md) + "\n")
    pipe.drop("film.srt", srt)
    de_txt, fr_txt, de_md, fr_md, de_srt, fr_srt = pipe.written(
        "story.de.txt", "story.fr.txt", "guide.de.md", "guide.fr.md", "film.de.srt", "film.fr.srt")
    assert rt.worker_pid(PID)

    # every paragraph reached the engine once, in order, and the answers are in that order
    for text, lang in ((de_txt, "German (de)"), (fr_txt, "French (fr)")):
        assert in_order(text, txt), text
        answers = answers_of(text)
        assert len(answers) > 1 and all(f"into {lang}." in a for a in answers)
        # one conversation per document and language: each chunk saw the ones before it
        assert saw_the_chunks_before(text, len(answers)), text
        assert text.endswith(")\n")
    assert "- story => Geschichte" in de_txt and "- story => histoire" in fr_txt  # the terms that occur
    assert "- film =>" not in de_txt
    assert in_order(de_md, md) and in_order(fr_md, md)
    assert "It is Markdown" in de_md and "```\ncode stays\n\ncode\n```" in de_md

    # subtitles: the numbers and timings are the source's; each cue's text is its answer's
    source = parse_srt(srt)
    for text in (de_srt, fr_srt):
        cues = parse_srt(text)
        assert [(c.number, c.timing) for c in cues] == [(c.number, c.timing) for c in source]
        assert all(c.text.startswith(s.text) for c, s in zip(cues, source)), text

    # each chunk ran one turn; the sources moved to done/ once their outputs were written
    chunks = sum(len(answers_of(t)) for t in (de_txt, fr_txt, de_md, fr_md))
    srt_chunks = len(HISTORY.findall(de_srt)) + len(HISTORY.findall(fr_srt))
    assert wait_until(lambda: Turn.objects.count() == chunks + srt_chunks, 10)
    assert Receipt.objects.values("conversation", "client_message_id").distinct().count() == chunks + srt_chunks
    assert Receipt.objects.values("conversation").distinct().count() == 6
    for name in ("story.txt", "guide.md", "film.srt"):
        assert pipe.settled(name)
    assert not list(pipe.outbox.glob(".*"))  # no temporary file left behind
    receipt = Receipt.objects.select_related("actor", "conversation").first()
    assert receipt.actor.key == "translate:pipeline" and receipt.conversation.channel == "translate"


def test_the_same_file_dropped_again_runs_no_new_turn(tcast, pipe, start_runtime):
    translate_plugin(pipe, to="de")
    start_runtime()
    text = "\n\n".join(paragraphs(6, "Again")) + "\n"
    pipe.drop("memo.txt", text)
    [first] = pipe.written("memo.de.txt")
    assert pipe.settled("memo.txt")
    turns = Turn.objects.count()
    assert turns > 1
    pipe.out("memo.de.txt").unlink()
    pipe.drop("memo.txt", text)       # the same name again
    pipe.drop("memo-copy.txt", text)  # and the same content under another name
    again, copy = pipe.written("memo.de.txt", "memo-copy.de.txt")
    assert again == first and copy == first
    assert pipe.settled("memo.txt") and pipe.settled("memo-copy.txt")
    wait_until(lambda: False, 1.0)
    assert Turn.objects.count() == turns
    # a changed file is a new document
    pipe.drop("memo.txt", text + "\nOne more paragraph at the end.\n")
    assert wait_until(lambda: Turn.objects.count() > turns, 30)


def test_a_worker_killed_mid_document_finishes_it_after_the_restart_each_chunk_once(tcast, pipe, start_runtime):
    translate_plugin(pipe, to="de")
    rt = start_runtime()
    assert wait_until(lambda: rt.worker_pid(PID), 30)
    paras = paragraphs(40, "Long")  # forty paragraphs, about twenty chunks of 200 characters, one after another
    pipe.drop("book.txt", "\n\n".join(paras) + "\n")
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="delivered").count() >= 3, 60, interval=0.01)
    first = rt.worker_pid(PID)
    os.kill(first, signal.SIGKILL)
    at_kill = OutboundDelivery.objects.filter(state="delivered").count()
    assert not pipe.out("book.de.txt").exists()  # the kill came mid-document
    [text] = pipe.written("book.de.txt")
    assert rt.worker_pid(PID) not in (None, first)
    assert in_order(text, paras), text
    answers = answers_of(text)
    assert len(answers) > at_kill
    assert saw_the_chunks_before(text, len(answers)), text  # the restart kept the conversation
    assert wait_until(lambda: Turn.objects.count() == len(answers), 10)
    assert Receipt.objects.values("client_message_id").distinct().count() == len(answers)
    assert pipe.settled("book.txt")


def test_an_unsupported_or_unreadable_file_goes_to_failed_with_the_reason(tcast, pipe, start_runtime):
    translate_plugin(pipe)
    start_runtime()
    pipe.drop("slides.pdf", b"%PDF-1.7 ...")
    pipe.drop("latin1.txt", "caf\u00e9 au lait\n".encode("latin-1"))
    pipe.drop("broken.srt", "1\nno timing\nhello\n")
    pipe.drop("broken.vtt", "1\n00:00:01.000 --> 00:00:02.000\nhello\n")
    pipe.drop("broken.po", 'msgid "hello"\nmsgstr "unterminated\n')
    pipe.drop("broken.html", "<p>Hello</p>\n<pre>never closed\n")
    for name in ("slides.pdf", "latin1.txt", "broken.srt", "broken.vtt", "broken.po", "broken.html"):
        assert pipe.settled(name, "failed"), name
    failed = pipe.inbox / "failed"
    assert (failed / "slides.pdf.error.txt").read_text() == (
        "unsupported file type '.pdf': this pipeline translates .htm, .html, .markdown, .md, .po, .pot, .srt, .txt, .vtt files\n")
    assert (failed / "latin1.txt.error.txt").read_text() == (
        "not UTF-8 text (byte 0xe9 at offset 3): save the file as UTF-8 and drop it again\n")
    assert (failed / "broken.srt.error.txt").read_text().startswith(
        "not a SubRip (.srt) file: block 1 has no timing line")
    assert (failed / "broken.vtt.error.txt").read_text().startswith(
        "not a WebVTT (.vtt) file: the first line must be 'WEBVTT'")
    assert (failed / "broken.po.error.txt").read_text().startswith(
        "not a gettext catalog (.po): line 2: expected a quoted string")
    assert (failed / "broken.html.error.txt").read_text().startswith(
        "not a well-formed HTML file: the <pre> opened at line 2 is never closed")
    assert not Receipt.objects.exists()
    assert not pipe.outbox.exists() or not list(pipe.outbox.iterdir())


def test_a_file_still_being_written_is_not_taken_early(tcast, pipe, start_runtime):
    translate_plugin(pipe, "--settle-secs", "1.5", to="de")
    rt = start_runtime()
    assert wait_until(lambda: "translate: watching" in rt.log(PID), 30), rt.log(PID)
    paras = paragraphs(12, "Growing")
    # a writer appending to the final name, a little at a time (no rename to mark the end)
    pipe.inbox.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()

    def write():
        with open(pipe.inbox / "growing.txt", "w") as fh:
            for p in paras:
                fh.write(p + "\n\n")
                fh.flush()
                time.sleep(0.1)
        stop.set()
    writer = threading.Thread(target=write)
    writer.start()
    # and a file under a temporary name, never taken until it is renamed
    (pipe.inbox / "later.txt.part").write_text("\n\n".join(paragraphs(2, "Later")))
    writer.join()
    assert stop.is_set()
    [text] = pipe.written("growing.de.txt")
    assert in_order(text, paras)  # all of it: not the part written when the worker first saw the file
    assert Turn.objects.count() == len(answers_of(text))  # and no turn for a part of it
    wait_until(lambda: False, 2.0)
    assert not (pipe.inbox / "failed").exists() or not list((pipe.inbox / "failed").iterdir())
    assert not pipe.out("later.de.txt").exists() and (pipe.inbox / "later.txt.part").exists()
    os.replace(pipe.inbox / "later.txt.part", pipe.inbox / "later.txt")
    [later] = pipe.written("later.de.txt")
    assert "Later paragraph 1" in later


def test_a_question_or_a_message_that_answers_no_chunk_is_acked_and_the_pipeline_goes_on(tcast, pipe, start_runtime):
    from channels_app.models import Conversation
    from plugins_app.channel.services import delivery_enqueue
    plugin = translate_plugin(pipe, to="de")
    start_runtime()
    pipe.drop("first.txt", "One short paragraph.\n")
    pipe.written("first.de.txt")
    conversation = Conversation.objects.get(channel="translate")
    question = delivery_enqueue(plugin=plugin, conversation=conversation, text="Formal or informal?\n1. Formal",
                                metadata={"kind": "question", "request_id": "q-1", "options": []})
    stray = delivery_enqueue(plugin=plugin, conversation=conversation, text="a workflow's message")
    pipe.drop("second.txt", "Another short paragraph.\n")
    [second] = pipe.written("second.de.txt")
    assert "Another short paragraph." in second
    assert wait_until(lambda: set(OutboundDelivery.objects.filter(delivery_id__in=[question.delivery_id,
                                                                                   stray.delivery_id])
                                  .values_list("state", flat=True)) == {"delivered"}, 30)
    assert Turn.objects.count() == 2


def test_a_wrong_argument_disables_the_plugin_with_the_reason(tcast, pipe, start_runtime):
    translate_plugin(pipe, to="de,Deutsch!")
    rt = start_runtime()
    assert wait_until(lambda: not Plugin.objects.get().enabled, 30), rt.log(PID)
    assert Plugin.objects.get().disabled_reason == (
        "the channel refused the worker: 'Deutsch!' is not a BCP 47 language tag (such as de, pt-BR, zh-Hant)")
    assert rt.worker_pid(PID) is None


def test_on_the_offline_notes_model_a_document_fails_with_the_reason_and_nothing_is_written(
        tcast, pipe, start_runtime, tmp_path):
    """The default ugent-notes quotes notes whatever it is asked: its 'translations' were unrelated notes
    passages, and the source moved to done/. The hub refuses each chunk instead, saying why."""
    from channels_app.services import MODEL_CANNOT_FOLLOW_PROMPTS
    from plugins_app.agent.models import AgentProfile
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "paris.md").write_text("Paris is the capital of France.\n")
    AgentProfile.objects.update(is_default=False)
    AgentProfile.objects.create(name="ugent-notes", provider="ugent-notes", is_default=True,
                                config={"path": str(tmp_path / "notes")})
    translate_plugin(pipe, to="de")
    start_runtime()
    pipe.drop("guide.md", "Paris is the capital of France.\n")
    assert pipe.settled("guide.md", "failed")
    reason = (pipe.inbox / "failed" / "guide.md.error.txt").read_text()
    assert reason == (f"the hub refused chunk 1 of 1 into de: "
                      f"{MODEL_CANNOT_FOLLOW_PROMPTS.format(name='ugent-notes')}\n"), reason
    assert not Receipt.objects.exists() and not Turn.objects.exists()
    assert not pipe.outbox.exists() or not list(pipe.outbox.iterdir())
