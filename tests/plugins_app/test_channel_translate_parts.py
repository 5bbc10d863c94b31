"""channel-translate's parts: reading and cutting documents, the instruction, putting answers back, the state."""
from __future__ import annotations

import pytest

from plugins_app.channel.workers.translate import config_problem, output_name, parse_args, skipped, write_atomic
from plugins_app.channel.workers.translate.documents import (Chunk, DocumentError, answer_cues, assemble,
                                                             blocks_of, glossary_for, instruction, parse_glossary,
                                                             parse_srt, read_document, split_cues, split_text)
from plugins_app.channel.workers.translate.state import (ANSWERED, FAILED, NEW, SUBMITTED, TranslateState,
                                                         conversation_id_for, message_id_for)

SRT = ("1\n00:00:01,000 --> 00:00:02,500\nHello there.\n\n"
       "2\n00:00:03,000 --> 00:00:04,000\nTwo lines\nof text.\n\n"
       "3\n00:00:05,000 --> 00:00:06,000\nBye.\n")


# ---------------------------------------------------------------------------- cutting

def test_paragraphs_are_packed_into_chunks_within_the_limit_and_never_cut():
    paras = [f"Paragraph {i} " + "word " * 20 for i in range(10)]  # about 115 characters each
    chunks = split_text("\n\n".join(paras) + "\n", 250)
    assert all(len(c.text) <= 250 for c in chunks)
    assert [c.text.split("\n\n") for c in chunks] == [paras[i:i + 2] for i in range(0, 10, 2)]
    assert [c.joiner for c in chunks] == ["\n\n"] * 4 + [""]


def test_blank_line_runs_and_crlf_are_one_paragraph_break():
    doc = read_document("a.txt", b"one\r\nline two\r\n\r\n\r\n\r\nthree\r\n", max_chars=1000)
    assert [c.text for c in doc.chunks] == ["one\nline two\n\nthree"]


def test_a_paragraph_longer_than_the_limit_is_cut_at_sentence_ends():
    sentences = [f"Sentence number {i} says something quite long here." for i in range(12)]
    chunks = split_text(" ".join(sentences), 200)
    assert len(chunks) > 1 and all(len(c.text) <= 200 for c in chunks)
    assert all(c.text.endswith(".") for c in chunks)  # no sentence is cut in two
    assert " ".join(c.text for c in chunks) == " ".join(sentences)
    assert [c.joiner for c in chunks][:-1] == [" "] * (len(chunks) - 1)  # rejoined as one paragraph


def test_a_sentence_longer_than_the_limit_is_cut_at_spaces_and_a_word_anywhere():
    text = "word " * 100 + "x" * 450
    chunks = split_text(text.strip(), 200)
    assert all(len(c.text) <= 200 for c in chunks)
    assert "".join(c.text for c in chunks).replace(" ", "") == text.replace(" ", "")


def test_a_markdown_code_fence_with_blank_lines_is_one_block():
    md = "# Title\n\n```python\nx = 1\n\ny = 2\n```\n\nAfter."
    assert blocks_of(md, markdown=True) == ["# Title", "```python\nx = 1\n\ny = 2\n```", "After."]
    assert blocks_of(md) == ["# Title", "```python\nx = 1", "y = 2\n```", "After."]


def test_subtitles_are_cut_at_cues_and_keep_numbers_and_timings():
    cues = parse_srt(SRT)
    assert [(c.number, c.timing, c.text) for c in cues] == [
        (1, "00:00:01,000 --> 00:00:02,500", "Hello there."),
        (2, "00:00:03,000 --> 00:00:04,000", "Two lines\nof text."),
        (3, "00:00:05,000 --> 00:00:06,000", "Bye.")]
    chunks = split_cues(cues, 40)
    assert [[c.number for c in ch.cues] for ch in chunks] == [[1, 2], [3]]
    assert chunks[0].text == "[1]\nHello there.\n\n[2]\nTwo lines\nof text."
    assert all(len(ch.text) <= 40 for ch in chunks)


def test_a_file_that_is_not_subrip_is_refused_with_the_reason():
    with pytest.raises(DocumentError, match=r"not a SubRip \(.srt\) file: block 2 has no timing line"):
        read_document("x.srt", b"1\n00:00:01,000 --> 00:00:02,000\nok\n\n2\nno timing here\n", max_chars=1000)


@pytest.mark.parametrize("name, data, reason", [
    ("a.pdf", b"%PDF-1.7", "unsupported file type '.pdf': this pipeline translates .htm, .html, .markdown, .md, .po, .pot, .srt, .txt, .vtt files"),
    ("README", b"hi", "unsupported file type with no suffix"),
    ("a.txt", b"caf\xe9", "not UTF-8 text (byte 0xe9 at offset 3)"),
    ("a.txt", b"  \n\n", "the file is empty"),
])
def test_files_the_pipeline_cannot_translate_say_why(name, data, reason):
    with pytest.raises(DocumentError) as err:
        read_document(name, data, max_chars=1000)
    assert str(err.value).startswith(reason)


def test_a_utf8_byte_order_mark_is_not_text():
    assert read_document("a.md", "\ufeff# Hi\n".encode(), max_chars=1000).chunks[0].text == "# Hi"


# ---------------------------------------------------------------------------- the instruction

def test_the_instruction_names_the_language_the_form_and_the_glossary_terms_in_the_chunk():
    glossary = parse_glossary("# terms\nUGENT = UGENT\ngateway = Gateway\n[fr]\ngateway = passerelle\n")
    assert glossary == {"*": {"UGENT": "UGENT", "gateway": "Gateway"}, "fr": {"gateway": "passerelle"}}
    chunk = Chunk("The **gateway** is up.")
    terms = glossary_for(glossary, "fr-CA", chunk.text)
    assert terms == {"gateway": "passerelle"}  # UGENT does not occur; fr applies to fr-CA
    text = instruction(chunk, form="markdown", lang="fr-CA", source_lang="en", name="a.md", index=1, total=3,
                       glossary=terms)
    assert text.startswith("Translate the text below from English (en) into French (fr-CA).\nIt is Markdown")
    assert "- gateway => passerelle" in text
    assert "part 2 of 3 of the document a.md" in text
    assert text.endswith("\n\nThe **gateway** is up.")


def test_a_bad_glossary_line_is_named():
    with pytest.raises(ValueError, match="glossary line 2: expected 'term = translation'"):
        parse_glossary("a = b\nno equals sign\n")


# ---------------------------------------------------------------------------- putting answers back

def test_answers_are_joined_in_chunk_order_as_the_source_was():
    chunks = [Chunk("A one. A two.", " "), Chunk("A three.", "\n\n"), Chunk("B.", "")]
    out = assemble("text", chunks, ["Ein eins. Ein zwei.\n", "\nEin drei.  ", "B."], trailing_newline=True)
    assert out == "Ein eins. Ein zwei. Ein drei.\n\nB.\n"
    assert not assemble("text", [Chunk("x", "")], ["y"], trailing_newline=False).endswith("\n")
    with pytest.raises(ValueError):
        assemble("text", chunks, ["only one"])


def test_subtitle_answers_take_the_source_numbers_and_timings_and_a_missing_cue_keeps_its_text():
    chunks = split_cues(parse_srt(SRT), 40)
    answers = ["Hier ist die Übersetzung:\n[1]\nHallo.\n\n[2]\nZwei Zeilen\nText.\n",
               "[7]\nfalsch"]  # the second answer names no cue 3
    missing: list[int] = []
    out = assemble("srt", chunks, answers, missing=missing)
    assert out == ("1\n00:00:01,000 --> 00:00:02,500\nHallo.\n\n"
                   "2\n00:00:03,000 --> 00:00:04,000\nZwei Zeilen\nText.\n\n"
                   "3\n00:00:05,000 --> 00:00:06,000\nBye.\n")
    assert missing == [3]
    assert answer_cues("[1]\na\n[2]\n\nb\n") == {1: "a", 2: "b"}


# ---------------------------------------------------------------------------- the worker's small parts

def test_output_names_keep_the_suffix_after_the_language():
    assert output_name("guide.md", "de") == "guide.de.md"
    assert output_name("film.en.SRT", "pt-BR") == "film.en.pt-BR.SRT"


def test_files_being_written_under_a_temporary_name_are_skipped():
    assert skipped("a.txt.part") and skipped(".a.txt") and skipped("a.txt.tmp") and skipped("a.txt~")
    assert not skipped("a.txt")


def test_the_arguments_an_operator_gets_wrong_are_named(tmp_path):
    ok = ["--inbox", str(tmp_path / "in"), "--outbox", str(tmp_path / "out"), "--to", "de,pt-BR"]
    assert config_problem(parse_args(ok)) is None
    assert config_problem(parse_args(ok[:4])) == "--to is required: the target languages, such as --to de,fr"
    assert config_problem(parse_args(ok[:-1] + ["de,Deutsch!"])) == (
        "'Deutsch!' is not a BCP 47 language tag (such as de, pt-BR, zh-Hant)")
    assert "different directories" in config_problem(parse_args(ok[:3] + [str(tmp_path / "in")] + ok[4:]))
    assert config_problem(parse_args(ok[2:])).startswith("--inbox and --outbox are required")


def test_write_atomic_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "a.de.txt"
    write_atomic(target, "first")
    write_atomic(target, "second")
    assert target.read_text() == "second" and [p.name for p in tmp_path.iterdir()] == ["a.de.txt"]


def test_the_state_keeps_answers_across_a_reopen_and_a_second_drop_asks_nothing_again(tmp_path):
    path = tmp_path / "w.translate"
    state = TranslateState(path)
    parts = [("prompt 0", {"text": "a", "joiner": "\n\n", "cues": []}), ("prompt 1", {"text": "b", "joiner": "",
                                                                                     "cues": []})]
    state.take(digest="d" * 64, name="a.txt", form="text", trailing_newline=True, chunks={"de": parts})
    first, second = state.chunks("d" * 64, "de")
    assert first.nonce and (first.conversation_id, first.message_id) == (
        conversation_id_for("d" * 64, "de"), message_id_for("d" * 64, "de", 0, "prompt 0", nonce=first.nonce))
    assert first.state == NEW
    state.submitted(first)
    assert state.chunk_of(first.conversation_id, first.message_id).state == SUBMITTED
    assert state.answered(first, "A") and not state.answered(first, "again")
    state.close()
    state = TranslateState(path)  # as after kill -9
    state.take(digest="d" * 64, name="copy.txt", form="text", trailing_newline=True,
               chunks={"de": [("other plan", {"text": "ab", "joiner": "", "cues": []})]})
    rows = state.chunks("d" * 64, "de")
    assert [(r.state, r.answer, r.prompt) for r in rows] == [(ANSWERED, "A", "prompt 0"), (NEW, None, "prompt 1")]
    assert {d.name for d in state.working()} == {"a.txt", "copy.txt"}
    state.close()


def test_a_failed_turn_is_asked_again_under_a_new_message_id_until_the_attempts_run_out(tmp_path):
    state = TranslateState(tmp_path / "s.translate")
    state.take(digest="e" * 64, name="a.txt", form="text", trailing_newline=True,
               chunks={"fr": [("p", {"text": "a", "joiner": "", "cues": []})]})
    [row] = state.chunks("e" * 64, "fr")
    assert not state.turn_failed(row, "boom", max_attempts=2)
    [again] = state.chunks("e" * 64, "fr")
    assert (again.attempt, again.state) == (2, NEW) and again.message_id != row.message_id
    assert state.chunk_of(row.conversation_id, row.message_id) is None  # a late answer to the old try is no answer
    assert state.turn_failed(again, "boom again", max_attempts=2)
    [gone] = state.chunks("e" * 64, "fr")
    assert (gone.state, gone.reason) == (FAILED, "boom again")
    state.take(digest="e" * 64, name="a.txt", form="text", trailing_newline=True, chunks={"fr": []})
    [retried] = state.chunks("e" * 64, "fr")  # dropped again: tried again
    assert (retried.state, retried.attempt) == (NEW, 3)
    state.close()


# ---------------------------------------------------------------------------- the pipeline, without a bridge

class Worker:
    """The worker's pipeline steps on a real inbox, with ``submit`` recording what the hub would get."""

    def __init__(self, root, *args, to="de"):
        from plugins_app.channel.sdk import SubmitResult
        from plugins_app.channel.workers.translate import TranslateWorker
        self.inbox, self.outbox = root / "in", root / "out"
        self.w = TranslateWorker(argv=["--inbox", str(self.inbox), "--outbox", str(self.outbox), "--to", to,
                                       "--max-chunk-chars", "200", *args],
                                 socket_path=str(root / "none.sock"), plugin_id="tr", token="t",
                                 state_dir=str(root / "state"), install_signal_handlers=False)
        self.sent: list = []
        self.w.submit = lambda msg: (self.sent.append(msg), SubmitResult(True))[1]
        self.w.connect()

    def drop(self, name, text):
        (self.inbox / name).write_text(text)
        st = (self.inbox / name).stat()
        self.w.take(name, (st.st_size, st.st_mtime_ns))
        self.w.pump()

    def answer(self, msg, text, state="completed", **meta):
        from plugins_app.channel.sdk import Delivery
        d = Delivery(delivery_id=f"d-{len(self.sent)}-{state}", conversation_id=msg.conversation_id, text=text,
                     reply_to_message_id=msg.message_id, metadata={"state": state, **meta})
        assert self.w.deliver(d) is None
        self.w.pump()


def test_chunks_go_one_after_another_and_the_output_is_written_once_all_are_answered(tmp_path):
    p = Worker(tmp_path)
    paras = [f"Paragraph {i} " + "word " * 25 for i in range(4)]
    p.drop("a.txt", "\n\n".join(paras) + "\n")
    assert len(p.sent) == 1  # the next chunk waits for this one's answer
    first = p.sent[0]
    assert first.channel == "translate" and first.text.endswith(paras[0])
    p.answer(first, "Absatz 0")
    p.answer(first, "a second copy of the delivery")  # a redelivery changes nothing
    assert len(p.sent) == 2 and p.sent[1].conversation_id == first.conversation_id
    for i in range(2, 5):
        assert not (p.outbox / "a.de.txt").exists()
        p.answer(p.sent[-1], f"Absatz {i - 1}")
    assert len(p.sent) == 4
    assert (p.outbox / "a.de.txt").read_text() == "Absatz 0\n\nAbsatz 1\n\nAbsatz 2\n\nAbsatz 3\n"
    assert (p.inbox / "done" / "a.txt").exists() and not (p.inbox / "a.txt").exists()


def test_a_failed_turn_is_asked_again_and_out_of_attempts_fails_the_document(tmp_path):
    p = Worker(tmp_path, "--max-attempts", "2")
    p.drop("a.txt", "Hello.\n")
    [first] = p.sent
    p.answer(first, "Sorry, the agent could not answer this message.", state="failed")
    retry = p.sent[-1]
    assert len(p.sent) == 2 and retry.message_id == first.message_id + ".try2"
    p.answer(first, "late answer to the first try")  # answers nothing now
    assert not (p.outbox / "a.de.txt").exists()
    p.answer(retry, "Sorry, the agent could not answer this message.", state="failed")
    assert len(p.sent) == 2
    assert (p.inbox / "failed" / "a.txt").exists() and not (p.outbox / "a.de.txt").exists()
    assert (p.inbox / "failed" / "a.txt.error.txt").read_text() == (
        "chunk 1 of 1 into de: the agent's turn ended failed: Sorry, the agent could not answer this message.\n")


def test_a_refused_turn_fails_the_document_at_once(tmp_path):
    p = Worker(tmp_path)
    p.drop("a.txt", "Hello.\n")
    p.answer(p.sent[0], "Please do not send passwords here.", state="refused")
    assert len(p.sent) == 1
    assert "ended refused: Please do not send passwords here." in (
        p.inbox / "failed" / "a.txt.error.txt").read_text()


def test_a_question_or_a_stray_delivery_is_acked_and_the_pipeline_goes_on(tmp_path):
    from plugins_app.channel.sdk import Delivery
    p = Worker(tmp_path)
    p.drop("a.txt", "Hello.\n")
    [msg] = p.sent
    question = Delivery(delivery_id="d_q1", conversation_id=msg.conversation_id, text="Formal or informal?",
                        reply_to_message_id=msg.message_id,
                        metadata={"kind": "question", "request_id": "q1", "options": []})
    stray = Delivery(delivery_id="d_x", conversation_id=msg.conversation_id, text="a workflow's message")
    assert p.w.deliver(question) is None and p.w.deliver(stray) is None
    assert not (p.outbox / "a.de.txt").exists()
    p.answer(msg, "Hallo.")
    assert (p.outbox / "a.de.txt").read_text() == "Hallo.\n"


def test_a_restarted_worker_goes_on_from_its_state(tmp_path):
    p = Worker(tmp_path)
    p.drop("a.txt", "\n\n".join(f"Paragraph {i} " + "word " * 25 for i in range(3)) + "\n")
    p.answer(p.sent[0], "Eins")
    p.w.disconnect()  # as if killed: the state is on disk
    again = Worker(tmp_path)
    again.w.pump()
    assert again.sent == []  # the chunk at work was submitted before: the SDK's outbox replays it if need be
    again.answer(p.sent[1], "Zwei")
    again.answer(again.sent[-1], "Drei")
    assert (again.outbox / "a.de.txt").read_text() == "Eins\n\nZwei\n\nDrei\n"


def test_a_journal_line_cut_short_by_a_crash_is_dropped_and_the_next_event_starts_a_line(tmp_path):
    state = TranslateState(tmp_path)
    parts = [("p0", {"text": "a", "joiner": "", "cues": []})]
    state.take(digest="f" * 64, name="a.txt", form="text", trailing_newline=True, chunks={"de": parts})
    [row] = state.chunks("f" * 64, "de")
    state.close()
    journal = tmp_path / ("f" * 64 + ".jsonl")
    with open(journal, "ab") as fh:
        fh.write(b'{"e":"answered","lang":"de","idx":0,"message_id":"' + row.message_id.encode() + b'","ans')
    state = TranslateState(tmp_path)
    [again] = state.chunks("f" * 64, "de")
    assert again.state == NEW  # the torn answer was never acted on (its delivery was not acked)
    assert state.answered(again, "A")
    state.close()
    assert journal.read_bytes().endswith(b'"answer":"A"}\n')
    [answered] = TranslateState(tmp_path).chunks("f" * 64, "de")
    assert (answered.state, answered.answer) == (ANSWERED, "A")


@pytest.mark.django_db
def test_the_kind_is_built_in_and_a_plugins_toml_entry_needs_no_command():
    import sys

    from plugins_app.channel import selectors, tomlio
    from plugins_app.channel.models import Plugin
    from plugins_app.channel.workers import installed_kinds
    kind = installed_kinds()["channel-translate"]
    assert kind.module == "plugins_app.channel.workers.translate" and kind.env_refs == ()
    assert kind.description.startswith("Translation: a directory pipeline")
    tomlio.plugins_import(text='schema_version = 1\n[[plugins]]\nid = "translate-main"\nkind = "channel-translate"\n'
                               'args = ["--inbox", "/srv/in", "--outbox", "/srv/out", "--to", "de,fr"]\n')
    assert selectors.plugin_argv(Plugin.objects.get()) == (
        sys.executable, ["-m", "plugins_app.channel.workers.translate", "--inbox", "/srv/in", "--outbox", "/srv/out",
                         "--to", "de,fr"])


# ---------------------------------------------------------------------------- what the inbox may hold

def settle_scan(p, rounds=3):
    import time
    for _ in range(rounds):
        p.w.scan()
        time.sleep(0.06)


def test_a_symbolic_link_in_the_inbox_is_never_read_it_goes_to_failed_as_a_link(tmp_path):
    import os
    secret = tmp_path / "secret.env"
    secret.write_text("DATABASE_URL=postgres://admin:hunter2@db/ugent\n")
    p = Worker(tmp_path, "--settle-secs", "0.05")
    os.symlink(secret, p.inbox / "notes.txt")
    settle_scan(p)
    p.w.pump()
    assert p.sent == []  # nothing of the linked file reached the agent
    assert (p.inbox / "failed" / "notes.txt").is_symlink() and not (p.inbox / "notes.txt").exists()
    assert "symbolic link" in (p.inbox / "failed" / "notes.txt.error.txt").read_text()
    assert secret.read_text().startswith("DATABASE_URL")


def test_a_file_swapped_for_a_link_after_the_scan_is_not_read_through_it(tmp_path):
    import os
    secret = tmp_path / "secret.env"
    secret.write_text("hunter2\n")
    p = Worker(tmp_path)
    (p.inbox / "a.txt").write_text("hunter2\n")  # the same size as the secret
    st = (p.inbox / "a.txt").stat()
    (p.inbox / "a.txt").unlink()
    os.symlink(secret, p.inbox / "a.txt")
    p.w.take("a.txt", (st.st_size, st.st_mtime_ns))
    p.w.pump()
    assert p.sent == [] and (p.inbox / "failed" / "a.txt").is_symlink()


def test_done_or_failed_as_a_symbolic_link_is_refused_and_nothing_is_moved_through_it(tmp_path):
    import os

    from plugins_app.channel.sdk import ChannelRefused
    p = Worker(tmp_path, "--settle-secs", "0.05")
    victim = tmp_path / "victim"
    victim.mkdir()
    (p.inbox / "failed").rmdir()
    os.symlink(victim, p.inbox / "failed")
    (p.inbox / "x.pdf").write_text("%PDF")
    settle_scan(p)
    assert os.listdir(victim) == [] and (p.inbox / "x.pdf").exists()
    with pytest.raises(ChannelRefused, match="failed is not a directory"):
        Worker(tmp_path)


def test_write_atomic_never_writes_through_a_link_and_leaves_no_temporary_file_on_error(tmp_path):
    import os
    victim = tmp_path / "victim.conf"
    victim.write_text("important\n")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(victim, out / "a.de.txt")
    write_atomic(out / "a.de.txt", "translated\n")  # the link is replaced, not followed
    assert victim.read_text() == "important\n" and (out / "a.de.txt").read_text() == "translated\n"
    (out / "dir.de.txt").mkdir()
    with pytest.raises(OSError):
        write_atomic(out / "dir.de.txt", "x")
    assert sorted(p.name for p in out.iterdir()) == ["a.de.txt", "dir.de.txt"]


# ---------------------------------------------------------------------------- a crash while a file is taken

def answer_all(q):
    """Answer every chunk sent (and those sent because of it) with its language and number."""
    answered: set = set()
    for _ in range(20):
        todo = [m for m in q.sent if m.message_id not in answered]
        if not todo:
            return
        for m in todo:
            answered.add(m.message_id)
            q.answer(m, f"{m.metadata['lang']}{m.metadata['chunk']}")


def _journal(root):
    [j] = (root / "state" / "tr.translate").glob("*.jsonl")
    return j


def test_a_plan_line_lost_to_a_power_cut_never_finishes_the_document_with_an_empty_translation(tmp_path):
    p = Worker(tmp_path, to="de,fr")
    text = "\n\n".join(f"Paragraph {i} " + "word " * 25 for i in range(3)) + "\n"
    (p.inbox / "a.txt").write_text(text)
    st = (p.inbox / "a.txt").stat()
    p.w.take("a.txt", (st.st_size, st.st_mtime_ns))
    p.w.disconnect()
    j = _journal(tmp_path)
    lines = j.read_bytes().split(b"\n")
    # the French plan's line came back as garbage (pages written out of order), the rest whole
    j.write_bytes(b"\n".join(b"\0" * 40 if b'"e":"chunks"' in ln and b'"lang":"fr"' in ln else ln for ln in lines))
    q = Worker(tmp_path, to="de,fr")
    q.w.pump()
    answer_all(q)
    assert not (q.outbox / "a.fr.txt").exists() and (q.inbox / "a.txt").exists()  # not finished as ""
    # the file is taken again: the lost plan is made anew, and every chunk of it is asked
    q.w.take("a.txt", (st.st_size, st.st_mtime_ns))
    q.w.pump()
    answer_all(q)
    assert (q.outbox / "a.fr.txt").read_text() == "fr1\n\nfr2\n\nfr3\n"
    assert (q.outbox / "a.de.txt").read_text() == "de1\n\nde2\n\nde3\n"
    assert (q.inbox / "done" / "a.txt").exists()


def test_a_crash_tearing_the_last_line_of_a_take_leaves_no_document_at_work_and_the_file_is_taken_again(tmp_path):
    p = Worker(tmp_path)
    (p.inbox / "a.txt").write_text("Hello world.\n")
    st = (p.inbox / "a.txt").stat()
    p.w.take("a.txt", (st.st_size, st.st_mtime_ns))
    p.w.disconnect()
    j = _journal(tmp_path)
    data = j.read_bytes()
    j.write_bytes(data[:-20])  # the take's last line cut short
    q = Worker(tmp_path)
    q.w.pump()
    assert not (q.outbox / "a.de.txt").exists() and (q.inbox / "a.txt").exists()
    q.w.take("a.txt", (st.st_size, st.st_mtime_ns))
    q.w.pump()
    q.answer(q.sent[-1], "Hallo Welt.")
    assert (q.outbox / "a.de.txt").read_text() == "Hallo Welt.\n"


# ---------------------------------------------------------------------------- a chunk that never gets an answer

def _past_the_timeout():
    import time
    time.sleep(0.12)


def test_a_chunk_submitted_but_never_answered_is_asked_again_after_the_turn_timeout(tmp_path):
    p = Worker(tmp_path, "--turn-timeout-secs", "0.1", "--max-attempts", "2")
    p.drop("a.txt", "Hello.\n")
    [first] = p.sent
    p.w.pump()
    assert len(p.sent) == 1  # within the timeout: it waits
    _past_the_timeout()  # an abandoned turn sends nothing: no delivery ever comes
    p.w.pump()
    assert [m.message_id for m in p.sent] == [first.message_id, first.message_id + ".try2"]
    _past_the_timeout()
    p.w.pump()  # out of attempts: the document fails with the reason
    assert "no answer within --turn-timeout-secs" in (p.inbox / "failed" / "a.txt.error.txt").read_text()


def test_a_chunk_still_pending_in_the_sdk_outbox_waits_and_one_the_hub_refused_on_replay_fails(tmp_path):
    p = Worker(tmp_path, "--turn-timeout-secs", "0.1")
    p.drop("a.txt", "Hello.\n")
    p.drop("b.txt", "Bye.\n")
    a, b = p.sent
    outbox = p.w._outbox()
    outbox.inbound_record(a)  # queued: the hub was not reached yet
    outbox.inbound_record(b)
    outbox.inbound_acked(b.key, {"accepted": False, "reason": "a rule refused it"})  # refused when replayed
    _past_the_timeout()
    p.w.pump()
    assert len(p.sent) == 2 and (p.inbox / "a.txt").exists()  # a waits for the SDK to hand it over
    assert (p.inbox / "failed" / "b.txt.error.txt").read_text() == (
        "chunk 1 of 1 into de: the hub refused it: a rule refused it\n")


def test_dropping_a_file_again_asks_a_stale_submitted_chunk_again(tmp_path):
    state = TranslateState(tmp_path / "s.translate")
    parts = {"de": [("p", {"text": "a", "joiner": "", "cues": []})]}
    state.take(digest="a" * 64, name="a.txt", form="text", trailing_newline=True, chunks=parts)
    [row] = state.chunks("a" * 64, "de")
    state.submitted(row)
    import time
    state.take(digest="a" * 64, name="a.txt", form="text", trailing_newline=True, chunks=parts,
               stale_before=time.time() - 60)
    assert state.chunks("a" * 64, "de")[0].state == SUBMITTED  # submitted a moment ago: left alone
    state.take(digest="a" * 64, name="a.txt", form="text", trailing_newline=True, chunks=parts,
               stale_before=time.time() + 1)
    [again] = state.chunks("a" * 64, "de")
    assert (again.state, again.attempt) == (NEW, 2)
    state.close()


# ---------------------------------------------------------------------------- one document in trouble

def test_a_document_that_cannot_be_finished_does_not_hold_up_the_next_and_fails_after_repeated_errors(
        tmp_path, monkeypatch):
    import plugins_app.channel.workers.translate as translate
    monkeypatch.setattr(translate, "DOCUMENT_BACKOFF_SECS", 0.0)
    p = Worker(tmp_path)
    (p.outbox / "a.de.txt").mkdir(parents=True)  # something in the way of a's output
    p.drop("a.txt", "Hello.\n")
    p.drop("b.txt", "Second.\n")
    a, b = p.sent
    p.answer(a, "Hallo.")  # a's output cannot be written: logged, the pump goes on
    p.answer(b, "Zweites.")
    assert (p.outbox / "b.de.txt").read_text() == "Zweites.\n" and (p.inbox / "done" / "b.txt").exists()
    assert (p.inbox / "a.txt").exists()
    for _ in range(translate.DOCUMENT_GIVE_UP):
        p.w.pump()
    assert "cannot finish the document: [Errno 21] Is a directory" in (
        p.inbox / "failed" / "a.txt.error.txt").read_text()
    assert p.w.state.working() == []


def test_a_name_too_long_for_the_names_made_from_it_goes_to_failed_with_the_reason(tmp_path):
    import os
    p = Worker(tmp_path)
    name = "L" * 240 + ".txt"
    p.drop(name, "Hello.\n")
    assert p.sent == [] and (p.inbox / "failed" / name).exists()
    [error] = [n for n in os.listdir(p.inbox / "failed") if n.endswith(".error.txt")]
    assert "the name is 244 bytes long: names of at most 236 bytes are taken" in (
        p.inbox / "failed" / error).read_text()


def test_a_name_that_is_not_utf8_goes_to_failed_instead_of_failing_on_every_scan(tmp_path):
    import os
    p = Worker(tmp_path, "--settle-secs", "0.05")
    with open(os.path.join(os.fsencode(str(p.inbox)), b"caf\xe9.txt"), "wb") as fh:
        fh.write(b"Hello world.\n")
    settle_scan(p)
    assert os.listdir(os.fsencode(str(p.inbox / "failed"))) and not [n for n in os.listdir(p.inbox)
                                                                      if n.endswith(".txt")]
    [error] = [n for n in os.listdir(p.inbox / "failed") if n.endswith(".error.txt")]
    assert (p.inbox / "failed" / error).read_text() == (
        "the name is not valid UTF-8 (caf\\xe9.txt): rename the file with a UTF-8 name\n")


class FakeHost:
    """The bridge's client as the SDK calls it: each inbound.submit answered by ``answer``."""
    closed = False

    def __init__(self, answer):
        self.answer, self.calls = answer, []

    def call(self, method, params, timeout=None, cancel=None):
        self.calls.append(params["message"]["message_id"])
        return self.answer(params)

    def close(self):
        pass


def test_a_document_the_hub_refused_is_asked_under_a_new_message_id_when_dropped_again(tmp_path):
    import os
    p = Worker(tmp_path)
    del p.w.submit  # the SDK's own submit, with its outbox, against a fake host
    p.w._client = FakeHost(lambda prm: {"accepted": False, "reason": "not in allowed_senders"})
    p.drop("a.txt", "Hello.\n")
    assert (p.inbox / "failed" / "a.txt.error.txt").read_text() == (
        "the hub refused chunk 1 of 1 into de: not in allowed_senders\n")
    [refused] = p.w._client.calls
    p.w._client = FakeHost(lambda prm: {"accepted": True, "duplicate": False})  # the operator fixed the rule
    os.replace(p.inbox / "failed" / "a.txt", p.inbox / "a.txt")
    st = (p.inbox / "a.txt").stat()
    p.w.take("a.txt", (st.st_size, st.st_mtime_ns))
    p.w.pump()
    assert p.w._client.calls == [refused + ".try2"]  # really asked again, not answered from the outbox's cache
    assert (p.inbox / "a.txt").exists()  # at work, not failed again


# ---------------------------------------------------------------------------- cutting keeps the layout

def identity(doc) -> str:
    """The document put back from answers that repeat each chunk: what the cutting kept of the layout."""
    return assemble(doc.form, doc.chunks, [c.text for c in doc.chunks], trailing_newline=doc.trailing_newline)


def test_a_long_markdown_list_is_cut_at_line_ends_and_keeps_its_lines():
    md = "# Changelog\n\n" + "\n".join(f"- Fixed bug number {i} in the parser." for i in range(12)) + "\n"
    doc = read_document("c.md", md.encode(), max_chars=200)
    assert len(doc.chunks) > 1 and all(len(c.text) <= 200 for c in doc.chunks)
    assert all(c.text.split("\n")[-1].startswith("- ") for c in doc.chunks[1:])  # whole items
    assert identity(doc) == md


def test_a_long_code_fence_is_never_cut_and_line_breaks_in_long_text_are_kept():
    code = "```python\n" + "\n".join(f"# Step {i}.\nx{i} = compute({i})" for i in range(12)) + "\n```"
    md = "Intro.\n\n" + code + "\n\nAfter.\n"
    doc = read_document("d.md", md.encode(), max_chars=200)
    assert code in [c.text for c in doc.chunks]  # whole, over the limit
    assert identity(doc) == md
    poem = "\n".join(f"Line {i} of a poem that goes on. And on." for i in range(12)) + "\n"
    doc = read_document("p.txt", poem.encode(), max_chars=200)
    assert len(doc.chunks) > 1 and identity(doc) == poem


def test_a_file_replaced_while_at_work_the_newer_version_wins_whichever_finishes_last(tmp_path):
    import os
    p = Worker(tmp_path)
    p.drop("a.txt", "Version one, first paragraph " + "x " * 100 + "\n\nVersion one, second.\n")
    v1 = p.sent[-1]
    p.drop("a.txt", "Version two.\n")  # the operator replaces it with a corrected version
    v2 = p.sent[-1]
    p.answer(v2, "Fassung zwei.")
    assert (p.outbox / "a.de.txt").read_text() == "Fassung zwei.\n"
    p.answer(v1, "Fassung eins, erster.")
    assert len(p.sent) == 2  # the replaced version asks nothing more
    assert (p.outbox / "a.de.txt").read_text() == "Fassung zwei.\n"  # and never overwrites the newer one
    assert os.listdir(p.inbox / "done") == ["a.txt"] and p.w.state.working() == []
    p.w.disconnect()
    q = Worker(tmp_path)  # the newest version per name is known again after a restart
    q.drop("a.txt", "Version one, first paragraph " + "x " * 100 + "\n\nVersion one, second.\n")
    q.answer(q.sent[-1], "Fassung eins, zweiter.")  # version one dropped again: now it is the newest
    assert (q.outbox / "a.de.txt").read_text() == "Fassung eins, erster. Fassung eins, zweiter.\n"


# ---------------------------------------------------------------------------- moving files out of the inbox

def test_moving_a_file_next_to_one_of_its_name_never_reads_either_whole(tmp_path):
    import tracemalloc
    p = Worker(tmp_path, "--max-file-bytes", "1000")
    for path, last in ((p.inbox / "failed" / "big.txt", b"1"), (p.inbox / "big.txt", b"2")):
        with open(path, "wb") as fh:  # sparse: 40 MB each on paper, nothing on disk
            fh.truncate(40 * 1024 * 1024)
            fh.seek(0, 2)
            fh.write(last)
    st = (p.inbox / "big.txt").stat()
    tracemalloc.start()
    try:
        p.w.take("big.txt", (st.st_size, st.st_mtime_ns))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 1024 * 1024, peak
    assert not (p.inbox / "big.txt").exists() and len([f for f in (p.inbox / "failed").glob("big*.txt") if not f.name.endswith(".error.txt")]) == 2


def test_two_files_of_one_name_failing_within_a_second_are_both_kept():
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as root:
        p = Worker(Path(root))
        for content in ("%PDF one", "%PDF two", "%PDF three"):
            (p.inbox / "x.pdf").write_text(content)
            st = (p.inbox / "x.pdf").stat()
            p.w.take("x.pdf", (st.st_size, st.st_mtime_ns))
        kept = sorted(f.read_text() for f in (p.inbox / "failed").iterdir() if not f.name.endswith(".error.txt"))
        assert kept == ["%PDF one", "%PDF three", "%PDF two"]


def test_subtitles_whose_numbering_restarts_are_marked_by_place_and_a_blank_line_in_an_answer_is_dropped():
    srt = ("1\n00:00:01,000 --> 00:00:02,000\nFirst part A.\n\n"
           "2\n00:00:03,000 --> 00:00:04,000\nFirst part B.\n\n"
           "1\n00:10:01,000 --> 00:10:02,000\nSecond part A.\n")
    [chunk] = split_cues(parse_srt(srt), 4000)
    assert chunk.text == "[1]\nFirst part A.\n\n[2]\nFirst part B.\n\n[3]\nSecond part A."
    answer = chunk.text.replace("part", "Teil").replace("B.", "B,\n\nzwei Zeilen.")
    out = assemble("srt", [Chunk.from_dict(chunk.to_dict())], [answer])
    assert out == ("1\n00:00:01,000 --> 00:00:02,000\nFirst Teil A.\n\n"
                   "2\n00:00:03,000 --> 00:00:04,000\nFirst Teil B,\nzwei Zeilen.\n\n"
                   "1\n00:10:01,000 --> 00:10:02,000\nSecond Teil A.\n")
    assert [(c.number, c.timing) for c in parse_srt(out)] == [(c.number, c.timing) for c in parse_srt(srt)]


def test_a_plan_made_afresh_after_its_journal_was_deleted_never_reuses_a_message_id(tmp_path, monkeypatch):
    from plugins_app.channel.workers.translate import state as state_module
    state = TranslateState(tmp_path / "s.translate")
    parts = {"de": [("p", {"text": "a", "joiner": "", "cues": []})]}
    state.take(digest="c" * 64, name="a.txt", form="text", trailing_newline=True, chunks=parts)
    [first] = state.chunks("c" * 64, "de")
    state.answered(first, "A")
    state.settle("c" * 64, "a.txt", "done")
    state.close()
    monkeypatch.setattr(state_module, "KEEP_SECS", -1)  # as 180 days later: the journal is deleted at start
    state = TranslateState(tmp_path / "s.translate")
    assert not list((tmp_path / "s.translate").glob("*.jsonl"))
    state.take(digest="c" * 64, name="a.txt", form="text", trailing_newline=True, chunks=parts)
    [again] = state.chunks("c" * 64, "de")
    # the hub (and the SDK's outbox) may still hold the first id: the same id would be answered as a duplicate
    assert again.state == NEW and again.message_id != first.message_id
    state.close()
