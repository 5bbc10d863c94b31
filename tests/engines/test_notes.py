"""The offline notes engines: BM25 index, sentence extractor and chat engine.

No database and no Django: the engines are plain OPM plugins.
"""
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

import pytest
from ovos_plugin_manager.templates.agents import (AgentMessage, ChatEngine,
                                                  DocumentIndexerEngine,
                                                  ExtractiveQAEngine,
                                                  MessageRole)

from plugins_app.agent.engines.base import ANSWER, CITATIONS, StreamItem, stream_items
from plugins_app.agent.engines.notes import (NOTHING_FOUND, NotesChatEngine,
                                       NotesIndexEngine, SentenceExtractor,
                                       default_notes_folder, split_markdown,
                                       stem, terms)

pytestmark = pytest.mark.mode_free  # engines and toolboxes in this process, no database, Redis or run mode

REPO = Path(__file__).resolve().parents[2]
SHIPPED_NOTES = REPO / "workspace" / "notes"

CORPUS = [
    "Ollama serves local models over an OpenAI-compatible API.",
    "The rule engine can ignore spam before the agent runs.",
    "Telegram and Slack are channel plugins run by the supervisor.",
    "Rules decide whether a message reaches the agent; rules live in rules.toml.",
]


def user(text):
    return AgentMessage(role=MessageRole.USER, content=text)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def shipped_engine():
    return NotesChatEngine({"path": str(SHIPPED_NOTES)})


@pytest.fixture
def live_folder(tmp_path):
    """A notes folder re-checked on every query."""
    notes = tmp_path / "notes"
    write(notes / "garden.md", "# Tomatoes\n\nWater the tomatoes every morning before nine.\n")
    return notes


# --------------------------------------------------------------------------
# Text analysis
# --------------------------------------------------------------------------


def test_stemming_meets_inflections():
    assert stem("configured") == stem("configure") == stem("configuration") == stem("configuring")
    assert stem("servers") == stem("server")
    assert stem("keys") == stem("key")
    assert stem("processes") == stem("process")


def test_terms_drop_stopwords_and_split_identifiers():
    assert terms("How do I point UGENT at my Ollama server?") == ["point", "ugent", "ollama", "server"]
    assert "llm" in terms("UGENT_LLM_BASE_URL")


# --------------------------------------------------------------------------
# NotesIndexEngine: the OPM DocumentIndexerEngine contract
# --------------------------------------------------------------------------


def test_index_is_an_opm_document_indexer():
    assert isinstance(NotesIndexEngine(), DocumentIndexerEngine)


def test_query_returns_sorted_content_score_tuples():
    index = NotesIndexEngine()
    index.ingest_corpus(CORPUS)
    results = index.query("In which file do the rules live?", k=3)

    assert 1 < len(results) <= 3
    assert all(isinstance(result, tuple) and len(result) == 2 for result in results)
    for content, score in results:
        assert content in CORPUS
        assert isinstance(score, float) and score > 0
    scores = [score for _content, score in results]
    assert scores == sorted(scores, reverse=True)
    assert results[0][0] == CORPUS[3]


def test_query_respects_k():
    index = NotesIndexEngine()
    index.ingest_corpus(CORPUS)
    question = "agent rules spam Ollama Telegram"
    assert len(index.query(question, k=1)) == 1
    assert len(index.query(question, k=2)) == 2
    assert len(index.query(question, k=50)) == len(CORPUS)  # k beyond the corpus is fine
    assert index.query(question, k=0) == []


def test_query_without_shared_terms_is_empty():
    index = NotesIndexEngine()
    assert index.query("anything") == []  # nothing ingested yet
    index.ingest_corpus(CORPUS)
    assert index.query("capital of France") == []
    assert index.query("") == []


def test_ingest_adds_to_the_index():
    index = NotesIndexEngine()
    index.ingest_corpus(CORPUS[:1])
    index.ingest_corpus(["Bananas ripen faster next to apples."])
    assert index.query("Ollama", k=1)[0][0] == CORPUS[0]
    assert index.query("bananas", k=1)[0][0].startswith("Bananas")


def test_query_is_deterministic():
    index = NotesIndexEngine()
    index.ingest_corpus(CORPUS)
    first = index.query("agent", k=4)
    assert all(index.query("agent", k=4) == first for _ in range(5))


# --------------------------------------------------------------------------
# NotesIndexEngine: folder mode
# --------------------------------------------------------------------------


def test_markdown_is_split_by_heading_and_keeps_its_source():
    text = "# Intro\n\nFirst part.\n\n## Setup\n\nSecond part.\n\n```sh\n# not a heading\n```\n"
    passages = split_markdown(text, source="guide.md")
    assert [(p.heading, p.source) for p in passages] == [("Intro", "guide.md"), ("Setup", "guide.md")]
    assert "# not a heading" in passages[1].text


@pytest.mark.parametrize("question, note", [
    ("How do I point UGENT at my Ollama server?", "configure-model.md"),
    ("Which environment variables set the upstream model?", "configure-model.md"),
    ("How do I send my API key?", "api-keys.md"),
    ("How do I ignore spam messages with a rule?", "rules.md"),
    ("How do I start the channel plugin workers?", "channel-plugins.md"),
    ("How do I add my own notes?", "about-these-notes.md"),
    ("What is UGENT?", "what-is-ugent.md"),
])
def test_shipped_notes_answer_first_questions(question, note):
    index = NotesIndexEngine({"path": str(SHIPPED_NOTES)})
    hits = index.query_passages(question, k=3)
    assert hits, question
    assert hits[0].source == note
    assert hits[0].score == max(h.score for h in hits)


def test_folder_mode_keeps_relative_paths_of_md_and_txt_only(tmp_path):
    write(tmp_path / "sub" / "deep" / "ferry.txt", "The ferry leaves the harbour at noon.")
    write(tmp_path / "ferry.rst", "The ferry leaves at midnight.")  # not a note
    write(tmp_path / ".hidden" / "ferry.md", "The ferry is secret.")
    index = NotesIndexEngine({"path": str(tmp_path)})

    hits = index.query_passages("When does the ferry leave?", k=5)
    assert [h.source for h in hits] == ["sub/deep/ferry.txt"]
    assert index.query("When does the ferry leave?") == [(hits[0].text, hits[0].score)]


def test_missing_folder_is_an_empty_index(tmp_path):
    assert NotesIndexEngine({"path": str(tmp_path / "nope")}).query("anything") == []


def test_reindexes_when_a_file_is_added(live_folder):
    index = NotesIndexEngine({"path": str(live_folder), "rescan_interval": 0})
    assert index.query_passages("When do the bees swarm?") == []

    write(live_folder / "bees.md", "# Bees\n\nThe bees swarm in late spring.\n")
    hits = index.query_passages("When do the bees swarm?")
    assert hits and hits[0].source == "bees.md"


def test_reindexes_when_a_file_is_modified_or_removed(live_folder):
    index = NotesIndexEngine({"path": str(live_folder), "rescan_interval": 0})
    assert index.query_passages("tomatoes")[0].source == "garden.md"

    write(live_folder / "garden.md", "# Cucumbers\n\nCucumbers climb the fence in summer.\n")
    assert index.query_passages("tomatoes") == []
    assert index.query_passages("cucumbers")[0].source == "garden.md"

    (live_folder / "garden.md").unlink()
    assert index.query_passages("cucumbers") == []


def test_unchanged_folder_is_not_rebuilt(live_folder):
    index = NotesIndexEngine({"path": str(live_folder), "rescan_interval": 0})
    first = index.refresh()
    index.query("tomatoes")
    assert index.refresh() is first


def test_folder_is_checked_at_most_once_per_rescan_interval(live_folder):
    index = NotesIndexEngine({"path": str(live_folder), "rescan_interval": 3600})
    index.query("tomatoes")
    write(live_folder / "bees.md", "The bees swarm in late spring.")
    assert index.query("bees") == []  # not looked at again yet
    index.refresh(force=True)
    assert index.query("bees")


def test_concurrent_queries_while_notes_change(live_folder):
    index = NotesIndexEngine({"path": str(live_folder), "rescan_interval": 0})
    stop = threading.Event()

    def writer():
        n = 0
        while not stop.is_set():
            n += 1
            write(live_folder / f"extra{n % 5}.md", f"# Extra {n}\n\nTomatoes note number {n}.\n")
            time.sleep(0.001)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        with ThreadPoolExecutor(max_workers=8) as pool:
            results = list(pool.map(lambda _: index.query("tomatoes", k=3), range(200)))
    finally:
        stop.set()
        thread.join()
    assert all(1 <= len(r) <= 3 for r in results)


# --------------------------------------------------------------------------
# SentenceExtractor
# --------------------------------------------------------------------------

EVIDENCE = (
    "UGENT is a gateway. The daemon reads three environment variables. "
    "Set UGENT_LLM_BASE_URL to the server's base URL. Restart afterwards."
)


def test_extractor_is_an_opm_extractive_qa_engine():
    assert isinstance(SentenceExtractor(), ExtractiveQAEngine)


def test_extractor_picks_the_answering_sentence():
    extractor = SentenceExtractor()
    best = extractor.get_best_passage(EVIDENCE, "What is the base URL setting?")
    assert best == "Set UGENT_LLM_BASE_URL to the server's base URL."


def test_extractor_adds_a_contiguous_sentence_with_missing_terms():
    evidence = "Ollama runs models locally. Its API listens on port 11434. Bananas are yellow."
    best = SentenceExtractor().get_best_passage(evidence, "Which port does the Ollama API use?")
    assert best == "Ollama runs models locally. Its API listens on port 11434."
    one = SentenceExtractor({"max_sentences": 1}).get_best_passage(
        evidence, "Which port does the Ollama API use?")
    assert one == "Its API listens on port 11434."


def test_extractor_keeps_the_sentence_a_pronoun_refers_to():
    evidence = "Run the supervisor with manage.py. It restarts crashed workers. Bread needs flour."
    best = SentenceExtractor().get_best_passage(evidence, "What restarts crashed workers?")
    assert best == "Run the supervisor with manage.py. It restarts crashed workers."


def test_extractor_ignores_headings_and_handles_lists():
    evidence = "# Keys and headers\n\n- Send the key as x-api-key.\n- Rotate keys yearly.\n"
    best = SentenceExtractor({"max_sentences": 1}).get_best_passage(evidence, "Which header carries the key?")
    assert best == "Send the key as x-api-key."


def test_the_passage_is_a_span_of_the_evidence_as_written():
    # the contract: "returns the span inside it that answers the question"; line breaks and spacing kept
    evidence = ("Intro text here.\n\nThe gateway reads   UGENT_LLM_BASE_URL\nfrom the environment. It restarts\n"
                "the workers on change.\n\n```\nexport UGENT_LLM_BASE_URL=http://x\n```\n")
    best = SentenceExtractor().get_best_passage(evidence, "Where does the gateway read UGENT_LLM_BASE_URL from?")
    assert best in evidence
    assert best.startswith("The gateway reads   UGENT_LLM_BASE_URL\nfrom the environment.")
    listed = "# Keys\n\n- Send the key\n  as x-api-key.\n- Rotate keys yearly.\n"
    one = SentenceExtractor({"max_sentences": 1}).get_best_passage(listed, "Which header carries the key?")
    assert one == "Send the key\n  as x-api-key." and one in listed


def test_extractor_returns_empty_without_overlap_and_is_deterministic():
    extractor = SentenceExtractor()
    assert extractor.get_best_passage(EVIDENCE, "capital of France") == ""
    assert extractor.get_best_passage("", "base URL") == ""
    answers = {extractor.get_best_passage(EVIDENCE, "environment variables base URL") for _ in range(5)}
    assert len(answers) == 1


# --------------------------------------------------------------------------
# NotesChatEngine
# --------------------------------------------------------------------------

OLLAMA = "How do I point UGENT at my Ollama server?"


def test_chat_engine_is_an_opm_chat_engine(shipped_engine):
    assert isinstance(shipped_engine, ChatEngine)
    assert shipped_engine.supports_tools is False


def test_chat_answer_quotes_the_model_config_note(shipped_engine):
    reply = shipped_engine.continue_chat([user(OLLAMA)], session_id="s1")
    assert isinstance(reply, AgentMessage)
    assert reply.role == MessageRole.ASSISTANT
    assert reply.content.startswith("From configure-model.md: ")
    assert "Ollama" in reply.content and "UGENT_LLM_BASE_URL" in reply.content
    # A quote, not an invention: every quoted sentence is in the note.
    note = " ".join((SHIPPED_NOTES / "configure-model.md").read_text().split())
    assert reply.content.removeprefix("From configure-model.md: ") in note


def test_chat_answers_the_last_user_message_only(shipped_engine):
    history = [
        AgentMessage(role=MessageRole.SYSTEM, content="Be brief."),
        user("How do I ignore spam messages?"),
        AgentMessage(role=MessageRole.ASSISTANT, content="From rules.md: ..."),
        user(OLLAMA),
    ]
    assert shipped_engine.continue_chat(history).content == \
        shipped_engine.continue_chat([user(OLLAMA)]).content
    as_dicts = [{"role": "user", "content": OLLAMA}]
    assert shipped_engine.continue_chat(as_dicts).content.startswith("From configure-model.md:")


def test_stream_tokens_really_stream_and_join_to_the_answer(shipped_engine):
    content = shipped_engine.continue_chat([user(OLLAMA)]).content
    tokens = list(shipped_engine.stream_tokens([user(OLLAMA)]))
    assert len(tokens) == len(content.split()) > 5
    assert "".join(tokens) == content


def test_stream_events_send_answer_then_citations(shipped_engine):
    content = shipped_engine.continue_chat([user(OLLAMA)]).content
    items = list(shipped_engine.stream_events([user(OLLAMA)], session_id="s1"))

    assert all(isinstance(item, StreamItem) for item in items)
    answer = [item for item in items if item.kind == ANSWER]
    assert len(answer) > 5
    assert "".join(item.text for item in answer) == content
    assert items[-1].kind == CITATIONS
    assert items[-1].data == {"ids": ["notes/configure-model.md"]}
    assert sum(item.kind == CITATIONS for item in items) == 1


def test_stream_items_uses_the_rich_stream(shipped_engine):
    items = list(stream_items(shipped_engine, [user(OLLAMA)]))
    assert items[-1].kind == CITATIONS


def test_should_stop_halts_the_stream(shipped_engine):
    seen = []

    def should_stop():
        return len(seen) >= 3

    for item in shipped_engine.stream_events([user(OLLAMA)], should_stop=should_stop):
        seen.append(item)
    assert [item.kind for item in seen] == [ANSWER, ANSWER, ANSWER]
    assert list(shipped_engine.stream_events([user(OLLAMA)], should_stop=lambda: True)) == []


@pytest.mark.parametrize("question", [
    "What is the capital of France?",
    "What's the weather like today?",
    "",
])
def test_unrelated_question_gets_the_plain_answer(shipped_engine, question):
    assert shipped_engine.continue_chat([user(question)]).content == NOTHING_FOUND
    items = list(shipped_engine.stream_events([user(question)]))
    assert "".join(item.text for item in items) == NOTHING_FOUND
    assert all(item.kind == ANSWER for item in items)  # nothing quoted, nothing cited


def test_no_user_message_gets_the_plain_answer(shipped_engine):
    system_only = [AgentMessage(role=MessageRole.SYSTEM, content="How do I point UGENT at Ollama?")]
    assert shipped_engine.continue_chat(system_only).content == NOTHING_FOUND


def test_min_score_filters_weak_passages(shipped_engine):
    strict = NotesChatEngine({"path": str(SHIPPED_NOTES), "min_score": 1000})
    assert strict.continue_chat([user(OLLAMA)]).content == NOTHING_FOUND


def test_empty_notes_folder_finds_nothing(tmp_path):
    engine = NotesChatEngine({"path": str(tmp_path)})
    assert engine.continue_chat([user(OLLAMA)]).content == NOTHING_FOUND


def test_chat_engine_sees_new_notes(live_folder):
    engine = NotesChatEngine({"path": str(live_folder), "rescan_interval": 0})
    question = "When do the bees swarm?"
    assert engine.continue_chat([user(question)]).content == NOTHING_FOUND

    write(live_folder / "animals" / "bees.md", "# Bees\n\nThe bees swarm in late spring. Honey comes later.\n")
    assert engine.continue_chat([user(question)]).content == \
        "From animals/bees.md: The bees swarm in late spring."
    items = list(engine.stream_events([user(question)]))
    assert items[-1].data == {"ids": ["notes/animals/bees.md"]}


def test_default_folder_follows_the_workspace(monkeypatch, tmp_path):
    monkeypatch.setenv("UGENT_WORKSPACE", str(tmp_path))
    assert default_notes_folder() == tmp_path / "notes"
    write(tmp_path / "notes" / "boat.md", "The boat is painted blue.")
    assert NotesChatEngine().continue_chat([user("What colour is the boat?")]).content == \
        "From boat.md: The boat is painted blue."

    monkeypatch.delenv("UGENT_WORKSPACE")
    assert default_notes_folder() == SHIPPED_NOTES
    assert NotesChatEngine().notes_folder == SHIPPED_NOTES


def test_shipped_notes_exist():
    notes = sorted(p.name for p in SHIPPED_NOTES.glob("*.md"))
    assert 4 <= len(notes) <= 6
    assert "configure-model.md" in notes


# --------------------------------------------------------------------------
# OPM discovery through the project's entry points
# --------------------------------------------------------------------------


def test_opm_discovers_the_engines_via_entry_points():
    try:
        metadata.distribution("ugent-django")
    except metadata.PackageNotFoundError:
        pytest.fail("the project is not installed: run `pip install -e .` in the repo")
    from ovos_plugin_manager.agents import (find_chat_plugins,
                                            find_document_indexer_plugins,
                                            find_extractive_qa_plugins)

    assert find_chat_plugins().get("ugent-notes") is NotesChatEngine
    assert find_document_indexer_plugins().get("ugent-notes-index") is NotesIndexEngine
    assert find_extractive_qa_plugins().get("ugent-sentence-extractor") is SentenceExtractor
