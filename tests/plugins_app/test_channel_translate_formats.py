"""channel-translate's structured formats: WebVTT, gettext catalogs and HTML pages.

For each: what is sent (only the human text), what is written back (the structure, byte for byte: an
identity "translation" gives the file back), a malformed file refused into failed/ with its reason and
nothing else touched, and one end-to-end run through the real supervisor.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from channels_app.models import Receipt
from plugins_app.channel.workers.translate import output_name
from plugins_app.channel.workers.translate.documents import (DocumentError, answer_cues, assemble, instruction,
                                                             read_document)
from plugins_app.channel.workers.translate.markup import parse_html
from plugins_app.channel.workers.translate.po import PLURAL_FORMS, parse_po, placeholders
from tests.plugins_app.conftest import wait_until
from tests.plugins_app.test_channel_translate import Pipeline, translate_plugin
from tests.plugins_app.test_channel_translate_parts import Worker

VTT = ("WEBVTT - a demo\nKind: captions\nLanguage: en\n\n"
       "STYLE\n::cue { color: yellow }\n\n"
       "REGION\nid:fred width:40%\n\n"
       "NOTE this note is\nnever sent\n\n"
       "1\n00:00:01.000 --> 00:00:02.500 align:start line:0\nHello <i>there</i>.\n\n"
       "intro two\n00:00:03.000 --> 00:00:04.000\n<v Roger>Two lines\nof text.\n\n"
       "00:05.000 --> 00:06.000\n\n\n"
       "01:00:07.000 --> 01:00:08.000 region:fred\nBye.\n")

PO = '''# A translator's comment.
#, fuzzy
msgid ""
msgstr ""
"Project-Id-Version: demo 1.0\\n"
"Language: \\n"
"Content-Type: text/plain; charset=CHARSET\\n"
"Plural-Forms: nplurals=INTEGER; plural=EXPRESSION;\\n"

#. Shown on the start page.
#: app/views.py:12
#, python-format
msgid "Hello %(name)s, you have %d messages"
msgstr ""

msgctxt "menu"
msgid "File"
msgstr "Datei"

#: app/models.py:40
#, fuzzy, python-brace-format
#| msgid "Old {count}"
msgid "New {count} items"
msgstr "Alt {count}"

msgid "One file"
msgid_plural "%d files"
msgstr[0] ""
msgstr[1] ""

msgid ""
"First line\\n"
"second line\\n"
msgstr ""
#~ msgid "Gone"
#~ msgstr "Weg"
'''

HTML = ('<!DOCTYPE html>\n<html lang="en">\n<head>\n  <meta charset="utf-8">\n  <title>The guide</title>\n'
        '  <style>p::before { content: "not text"; }</style>\n</head>\n<body>\n'
        '  <!-- a comment stays -->\n'
        '  <h1 class="top">Welcome</h1>\n'
        '  <p>Fish &amp; chips, <a href="/menu" title="The menu">see the menu</a>.</p>\n'
        '  <img src="a.png" alt="A picture">\n'
        '  <pre>keep  this\n  as it is</pre>\n  <p>Run <code>make test</code> first.</p>\n'
        '  <script>if (a < b) { document.write("<p>not text</p>"); }</script>\n'
        '  <ul><li>One &lt; two</li><li>2024</li><li>&nbsp;</li><li>&copy; 2024</li></ul>\n</body>\n</html>\n')


@pytest.fixture
def pipe(short_dir):
    return Pipeline(short_dir / "pipe")


def sent_texts(doc) -> list[str]:
    return [t for c in doc.chunks for u in c.units for _, t in u["texts"]]


def answers_by(doc, fn) -> list[str]:
    """One answer per chunk, each text under its mark changed by ``fn`` (and a chatty line first)."""
    return ["Here it is:\n" + "\n\n".join(f"[{m}]\n{fn(t)}" for u in c.units for m, t in u["texts"])
            for c in doc.chunks]


def identity(name: str, text: str, max_chars: int = 1000):
    doc = read_document(name, text.encode(), max_chars=max_chars)
    assert assemble(doc.form, doc.chunks, [""] * len(doc.chunks)) == text  # no answer at all
    return doc


# ---------------------------------------------------------------------------- WebVTT

def test_webvtt_sends_only_the_cue_texts_and_an_identity_translation_gives_the_same_bytes():
    doc = identity("talk.vtt", VTT, max_chars=60)
    assert sent_texts(doc) == ["Hello <i>there</i>.", "<v Roger>Two lines\nof text.", "Bye."]
    assert len(doc.chunks) == 2 and all(len(c.text) <= 60 for c in doc.chunks)
    sent = "\n".join(c.text for c in doc.chunks)
    for structure in ("WEBVTT", "Kind:", "STYLE", "REGION", "NOTE", "intro two", "-->", "align:start"):
        assert structure not in sent
    assert assemble(doc.form, doc.chunks, answers_by(doc, lambda t: t)) == VTT
    assert "subtitle file" in instruction(doc.chunks[0], form="vtt", lang="de", source_lang=None, name="talk.vtt",
                                          index=0, total=2)


def test_webvtt_answers_replace_the_cue_texts_and_nothing_else():
    doc = read_document("talk.vtt", VTT.encode(), max_chars=1000)
    missing: list[int] = []
    answers = ["[1]\nHallo <i>da</i>.\n\n\n[2]\n<v Roger>Zwei Zeilen\n\nText --> hier.\n"]  # cue 3 left out
    out = assemble(doc.form, doc.chunks, answers, missing=missing, lang="de")
    assert out == VTT.replace("Hello <i>there</i>.", "Hallo <i>da</i>.").replace(
        "<v Roger>Two lines\nof text.", "<v Roger>Zwei Zeilen\nText -> hier.")
    assert missing == [3]


def test_a_cue_whose_identifier_is_note_is_a_cue():
    text = "WEBVTT\n\nNOTE\n00:00:01.000 --> 00:00:02.000\nA cue named NOTE.\n\nNOTE\nA note.\n"
    doc = identity("named.vtt", text)
    assert sent_texts(doc) == ["A cue named NOTE."]


@pytest.mark.parametrize("text, reason", [
    ("1\n00:00:01.000 --> 00:00:02.000\nHi\n", "not a WebVTT (.vtt) file: the first line must be 'WEBVTT'"),
    ("WEBVTT\n\n1\n00:00:01.000 --> 00:00:02.000\nHi\n\n2\nno timing\nHo\n",
     "not a WebVTT (.vtt) file: block 3 (line 7) is not a cue: it has no timing line"),
    ("WEBVTT\n\n1\n00:00:01,000 --> 00:00:02,000\nSubRip commas\n", "not a WebVTT (.vtt) file: block 2 (line 3)"),
    ("WEBVTT\n\nNOTE only a note\n", "the WebVTT file has no cue with text"),
])
def test_a_malformed_webvtt_file_is_refused_with_the_reason(text, reason):
    with pytest.raises(DocumentError) as err:
        read_document("bad.vtt", text.encode(), max_chars=1000)
    assert str(err.value).startswith(reason)


# ---------------------------------------------------------------------------- gettext

def test_a_catalog_sends_only_the_untranslated_and_fuzzy_msgids_and_writes_itself_back_unchanged():
    doc = identity("messages.pot", PO)
    assert sent_texts(doc) == ["Hello %(name)s, you have %d messages", "New {count} items", "One file", "%d files",
                               "First line\nsecond line\n"]
    assert "Datei" not in doc.chunks[0].text and "Project-Id-Version" not in doc.chunks[0].text
    assert "Gone" not in doc.chunks[0].text
    # no answer for any entry, into German: only the header changes
    out = assemble(doc.form, doc.chunks, ["nothing"] * len(doc.chunks), lang="de")
    assert out == PO.replace('"Language: \\n"', '"Language: de\\n"').replace("charset=CHARSET", "charset=UTF-8").replace(
        "nplurals=INTEGER; plural=EXPRESSION;", "nplurals=2; plural=(n != 1);")
    assert output_name("messages.pot", "pt-BR") == "messages.pt-BR.po"
    assert output_name("app.de.PO", "fr") == "app.de.fr.PO"


def german(text: str) -> str:
    return {"Hello %(name)s, you have %d messages": "Hallo %(name)s, du hast %d Nachrichten",
            "New {count} items": "{count} neue Dinge", "One file": "Eine Datei", "%d files": "%d Dateien",
            "First line\nsecond line": "Erste Zeile\nzweite Zeile"}[text.rstrip("\n")]


def test_answers_fill_msgstr_keep_comments_context_and_flags_and_drop_fuzzy():
    doc = read_document("messages.pot", PO.encode(), max_chars=1000)
    out = assemble(doc.form, doc.chunks, answers_by(doc, german), lang="de")
    assert out == '''# A translator's comment.
#, fuzzy
msgid ""
msgstr ""
"Project-Id-Version: demo 1.0\\n"
"Language: de\\n"
"Content-Type: text/plain; charset=UTF-8\\n"
"Plural-Forms: nplurals=2; plural=(n != 1);\\n"

#. Shown on the start page.
#: app/views.py:12
#, python-format
msgid "Hello %(name)s, you have %d messages"
msgstr "Hallo %(name)s, du hast %d Nachrichten"

msgctxt "menu"
msgid "File"
msgstr "Datei"

#: app/models.py:40
#, python-brace-format
msgid "New {count} items"
msgstr "{count} neue Dinge"

msgid "One file"
msgid_plural "%d files"
msgstr[0] "Eine Datei"
msgstr[1] "%d Dateien"

msgid ""
"First line\\n"
"second line\\n"
msgstr ""
"Erste Zeile\\n"
"zweite Zeile\\n"
#~ msgid "Gone"
#~ msgstr "Weg"
'''


def test_plural_forms_follow_the_target_and_an_unknown_target_gets_two_forms_marked_fuzzy():
    doc = read_document("messages.pot", PO.encode(), max_chars=1000)
    answers = answers_by(doc, german)
    ja = assemble(doc.form, doc.chunks, answers, lang="ja")
    assert '"Plural-Forms: nplurals=1; plural=0;\\n"' in ja
    assert 'msgid_plural "%d files"\nmsgstr[0] "%d Dateien"\n\n' in ja  # one form: the plural's
    ru = assemble(doc.form, doc.chunks, answers, lang="ru")
    assert ('#, fuzzy\nmsgid "One file"\nmsgid_plural "%d files"\nmsgstr[0] "Eine Datei"\nmsgstr[1] "%d Dateien"\n'
            'msgstr[2] "%d Dateien"\n') in ru  # three forms: the third is a guess a translator checks
    eo = assemble(doc.form, doc.chunks, answers, lang="eo")
    # not known, and the template has no rule: two forms, fuzzy, and the two-form rule gettext needs to read them
    assert '"Language: eo\\n"' in eo and '"Plural-Forms: nplurals=2; plural=(n != 1);\\n"' in eo
    assert '#, fuzzy\nmsgid "One file"\nmsgid_plural "%d files"\nmsgstr[0] "Eine Datei"\nmsgstr[1] "%d Dateien"\n\n' in eo
    assert 'msgstr "Hallo %(name)s, du hast %d Nachrichten"' in eo  # the singular entries are not guesses
    # not known, and the catalog's header has a rule: as many forms as it says, fuzzy, the header left as it was
    rule = "nplurals=3; plural=(n==1 ? 0 : n==2 ? 1 : 2);"
    ga = read_document("ga.po", PO.replace("nplurals=INTEGER; plural=EXPRESSION;", rule).encode(), max_chars=1000)
    out = assemble(ga.form, ga.chunks, answers_by(ga, german), lang="ga")
    assert rule in out and 'msgstr[0] "Eine Datei"\nmsgstr[1] "%d Dateien"\nmsgstr[2] "%d Dateien"\n' in out
    pt = assemble(doc.form, doc.chunks, answers, lang="pt-BR")
    assert '"Language: pt_BR\\n"' in pt and "nplurals=2; plural=(n > 1);" in pt


def test_an_answer_that_changes_a_placeholder_leaves_the_entry_untranslated_and_fuzzy():
    doc = read_document("messages.po", PO.encode(), max_chars=1000)
    broken = {"Hello %(name)s, you have %d messages": "Hallo %(nom)s, du hast %d Nachrichten",
              "New {count} items": "neue Dinge", "One file": "Eine Datei", "%d files": "Dateien",
              "First line\nsecond line\n": "Erste Zeile\nzweite Zeile"}
    notes: list[str] = []
    out = assemble(doc.form, doc.chunks, answers_by(doc, broken.__getitem__), lang="de", notes=notes)
    assert notes == [
        "msgid 'Hello %(name)s, you have %d messages': the answer 'Hallo %(nom)s, du hast %d Nachrichten' does "
        "not hold its placeholders (%(name)s %d); left untranslated, marked fuzzy",
        "msgid 'New {count} items': the answer 'neue Dinge' does not hold its placeholders ({count}); left "
        "untranslated, marked fuzzy",
        "msgid_plural '%d files': the answer 'Dateien' does not hold its placeholders (%d); left untranslated, "
        "marked fuzzy"]
    assert ('#: app/views.py:12\n#, fuzzy, python-format\nmsgid "Hello %(name)s, you have %d messages"\n'
            'msgstr ""\n') in out
    assert '#, fuzzy, python-brace-format\n#| msgid "Old {count}"\nmsgid "New {count} items"\nmsgstr "Alt {count}"' in out
    assert '#, fuzzy\nmsgid "One file"\nmsgid_plural "%d files"\nmsgstr[0] ""\nmsgstr[1] ""\n' in out
    assert '"Erste Zeile\\n"\n"zweite Zeile\\n"' in out  # the other entries go on
    assert placeholders("%s and %(n)d and {x} and {} and 50% off and 100%") == ["%(n)d", "%s", "{x}", "{}"]


def test_plain_placeholders_must_keep_their_order_numbered_and_named_ones_may_move():
    text = ('#, c-format\nmsgid "%s has %d files"\nmsgstr ""\n\n'
            '#, python-format\nmsgid "%(user)s sent %(count)d files"\nmsgstr ""\n\n'
            '#, c-format\nmsgid "%1$s has %2$d files"\nmsgstr ""\n\n'
            '#, python-brace-format\nmsgid "{} has {} files"\nmsgstr ""\n')
    doc = read_document("order.po", text.encode(), max_chars=1000)
    swapped = {"%s has %d files": "%d Dateien hat %s", "%(user)s sent %(count)d files": "%(count)d Dateien von %(user)s",
               "%1$s has %2$d files": "%2$d Dateien hat %1$s", "{} has {} files": "{} Dateien hat {}"}
    notes: list[str] = []
    out = assemble(doc.form, doc.chunks, answers_by(doc, swapped.__getitem__), lang="de", notes=notes)
    # the plain %s %d swapped would hand the count to %s: left untranslated and fuzzy
    assert '#, fuzzy, c-format\nmsgid "%s has %d files"\nmsgstr ""\n' in out
    assert notes == ["msgid '%s has %d files': the answer '%d Dateien hat %s' does not hold its placeholders "
                     "(%d %s); left untranslated, marked fuzzy"]
    assert 'msgstr "%(count)d Dateien von %(user)s"' in out and 'msgstr "%2$d Dateien hat %1$s"' in out
    assert 'msgstr "{} Dateien hat {}"' in out  # same placeholders, same order


#: A catalog with a c-format entry and a plural entry, whose header has no Plural-Forms line.
NO_RULE = ('msgid ""\nmsgstr ""\n"Content-Type: text/plain; charset=UTF-8\\n"\n\n'
           '#, c-format\nmsgid "%s has %d files"\nmsgstr ""\n\n'
           'msgid "One file"\nmsgid_plural "%d files"\nmsgstr[0] ""\nmsgstr[1] ""\n')
#: The same with no header entry at all.
NO_HEADER = NO_RULE[NO_RULE.index("#, c-format"):]


def swapping(text: str) -> str:
    return {"%s has %d files": "%d Dateien hat %s", "One file": "Eine Datei", "%d files": "%d Dateien"}[text]


@pytest.mark.skipif(not shutil.which("msgfmt"), reason="GNU gettext's msgfmt is not installed")
@pytest.mark.parametrize("lang", ["de", "fr", "ja", "ru", "ar", "eo", "pt-BR"])
@pytest.mark.parametrize("case", ["template", "no placeholders", "swapped", "swapped, no rule", "no header"])
def test_gnu_msgfmt_checks_every_catalog_written_and_finds_nothing_wrong(tmp_path, lang, case):
    cases = {"template": (PO, german), "no placeholders": (PO, lambda t: "ohne Platzhalter"),
             "swapped": (NO_RULE.replace('UTF-8\\n"\n', 'UTF-8\\n"\n"Plural-Forms: nplurals=INTEGER; plural=EXPRESSION;\\n"\n'),
                         swapping),
             "swapped, no rule": (NO_RULE, swapping), "no header": (NO_HEADER, swapping)}
    for n, (source, fn) in enumerate([cases[case]]):
        doc = read_document("messages.pot", source.encode(), max_chars=1000)
        path = tmp_path / f"{lang}.{n}.po"
        path.write_text(assemble(doc.form, doc.chunks, answers_by(doc, fn), lang=lang))
        done = subprocess.run(["msgfmt", "--check", "-o", str(tmp_path / "out.mo"), str(path)], capture_output=True,
                              text=True)
        assert done.returncode == 0, done.stderr + path.read_text()


def test_a_catalog_with_plurals_gets_the_plural_rule_and_one_with_no_header_a_minimal_header():
    doc = identity("rule.po", NO_RULE)
    out = assemble(doc.form, doc.chunks, answers_by(doc, swapping), lang="ru")
    assert out.startswith('msgid ""\nmsgstr ""\n"Content-Type: text/plain; charset=UTF-8\\n"\n"Language: ru\\n"\n'
                          f'"Plural-Forms: {PLURAL_FORMS["ru"]}\\n"\n\n#, fuzzy, c-format\n')
    doc = identity("bare.po", NO_HEADER)
    out = assemble(doc.form, doc.chunks, answers_by(doc, swapping), lang="eo")
    assert out == ('msgid ""\nmsgstr ""\n"Content-Type: text/plain; charset=UTF-8\\n"\n"Language: eo\\n"\n'
                   '"Plural-Forms: nplurals=2; plural=(n != 1);\\n"\n\n'
                   '#, fuzzy, c-format\nmsgid "%s has %d files"\nmsgstr ""\n\n'
                   '#, fuzzy\nmsgid "One file"\nmsgid_plural "%d files"\nmsgstr[0] "Eine Datei"\nmsgstr[1] "%d Dateien"\n')
    # with no plural entry, no Plural-Forms line is added
    doc = read_document("single.po", NO_HEADER[:NO_HEADER.index("msgid \"One")].encode(), max_chars=1000)
    out = assemble(doc.form, doc.chunks, [""], lang="de")
    assert out.startswith('msgid ""\nmsgstr ""\n"Content-Type: text/plain; charset=UTF-8\\n"\n"Language: de\\n"\n\n#')


RU = ('msgid ""\nmsgstr ""\n"Language: ru\\n"\n"Plural-Forms: nplurals=3; plural=(n%10==1 ? 0 : n%10>=2 ? 1 : 2);\\n"\n\n'
      'msgid "File"\nmsgstr "Файл"\n\nmsgid "Edit"\nmsgstr ""\n')


def test_a_catalog_in_another_language_than_the_target_is_refused():
    with pytest.raises(DocumentError) as err:
        read_document("ru.po", RU.encode(), max_chars=1000, langs=["ru", "de"])
    assert str(err.value) == ("the catalog is in ru (its header's Language:), not de: its translations and plural "
                              "forms are ru's; drop its template (.pot), or a catalog whose Language: is empty or "
                              "the target")
    assert sent_texts(read_document("ru.po", RU.encode(), max_chars=1000, langs=["ru"])) == ["Edit"]
    pt = RU.replace("Language: ru", "Language: pt_BR")
    assert sent_texts(read_document("pt.po", pt.encode(), max_chars=1000, langs=["pt-BR"])) == ["Edit"]
    with pytest.raises(DocumentError):
        read_document("pt.po", pt.encode(), max_chars=1000, langs=["pt-PT"])
    empty = RU.replace("Language: ru", "Language: ")
    assert sent_texts(read_document("new.po", empty.encode(), max_chars=1000, langs=["de"])) == ["Edit"]


@pytest.mark.parametrize("text, reason", [
    ('msgid "a"\nmsgstr[0] "b"\n', "not a gettext catalog (.po): the entry at line 1 has msgstr[n] but no msgid_plural"),
    ('msgid "a"\nmsgstr "b\n', "not a gettext catalog (.po): line 2: expected a quoted string"),
    ('msgid "a"\nmsgstr ""\nhello\n', "not a gettext catalog (.po): line 3: expected a comment, a keyword"),
    ('msgid "a"\n# note\nmsgstr ""\n', "not a gettext catalog (.po): line 2: a comment inside an entry"),
    ('msgid "a\\q"\nmsgstr ""\n', "not a gettext catalog (.po): line 1: unknown escape '\\q'"),
    ('msgid "a"\n', "not a gettext catalog (.po): the entry at line 1 needs one msgstr"),
    ("Just some text.\n", "not a gettext catalog (.po): line 1: expected a comment"),
    ('msgid "a"\nmsgstr "b"\n', "every entry of the catalog is translated already"),
])
def test_a_malformed_catalog_is_refused_with_the_reason(text, reason):
    with pytest.raises(DocumentError) as err:
        read_document("bad.po", text.encode(), max_chars=1000)
    assert str(err.value).startswith(reason), str(err.value)


# ---------------------------------------------------------------------------- HTML

def test_html_sends_only_text_nodes_and_an_identity_translation_gives_the_same_bytes():
    doc = identity("guide.html", HTML, max_chars=40)
    assert sent_texts(doc) == ["The guide", "Welcome", "Fish &amp; chips,", "The menu", "see the menu", "A picture",
                               "Run", "first.", "One &lt; two"]
    sent = "\n".join(c.text for c in doc.chunks)
    for never in ("<", "href", "/menu", "a.png", "keep", "make test", "not text", "a comment", "2024", "top",
                  "nbsp", "copy"):
        assert never not in sent, never
    assert assemble(doc.form, doc.chunks, answers_by(doc, lambda t: t)) == HTML


def test_html_answers_replace_the_text_nodes_in_place_and_never_open_a_tag():
    doc = read_document("guide.htm", HTML.encode(), max_chars=1000)
    words = {"The guide": "Der Leitfaden", "Welcome": "Willkommen", "Fish &amp; chips,": "Fisch &amp; Pommes,",
             "The menu": 'Die "Karte"', "see the menu": "siehe <b>Karte", "A picture": "Ein Bild", "Run": "Führe",
             "first.": "zuerst aus.", "One &lt; two": "Eins &lt; zwei"}
    out = assemble(doc.form, doc.chunks, answers_by(doc, words.__getitem__), lang="de")
    expected = HTML
    for source, target in (("<title>The guide<", "<title>Der Leitfaden<"), (">Welcome<", ">Willkommen<"),
                           ("<p>Fish &amp; chips, <a", "<p>Fisch &amp; Pommes, <a"),
                           ('title="The menu">see the menu<', 'title="Die &quot;Karte&quot;">siehe &lt;b>Karte<'),
                           ('alt="A picture"', 'alt="Ein Bild"'), ("<p>Run <code>", "<p>Führe <code>"),
                           ("</code> first.</p>", "</code> zuerst aus.</p>"), ("<li>One &lt; two<", "<li>Eins &lt; zwei<")):
        assert source in expected
        expected = expected.replace(source, target)
    assert out == expected


def test_only_quoted_alt_and_title_values_are_sent_and_an_answer_never_ends_the_attribute():
    text = """<p title='A tip' data-x="a title='not this'" alt=bare>Hi <img alt = ' A pic ' src=x/></p>\n"""
    doc = identity("attrs.html", text)
    assert sent_texts(doc) == ["A tip", "Hi", "A pic"]
    out = assemble(doc.form, doc.chunks, ["[1]\nIt's a tip\n[2]\nHallo\n[3]\nAn \"image\""], lang="de")
    assert out == """<p title='It&#39;s a tip' data-x="a title='not this'" alt=bare>Hallo <img alt = ' An "image" ' src=x/></p>\n"""


def test_the_head_ends_where_the_body_begins_though_both_tags_are_left_out():
    doc = identity("nobody.html", "<html><head><title>T</title><meta charset=utf-8>\n<p>Hello world</p>\n")
    assert sent_texts(doc) == ["T", "Hello world"]
    doc = identity("words.html", "<head><title>T</title><link rel=x title='Not sent'> &nbsp; Loose words "
                                 "<b title='A tip'>bold</b></head>\n")
    assert sent_texts(doc) == ["T", "&nbsp; Loose words", "A tip", "bold"]
    doc = identity("full.html", "<head><title>T</title><style>p {}</style><script>x</script><noscript>"
                                "</noscript><base href=/><link rel=x title='No'></head><body><p>Body</p></body>\n")
    assert sent_texts(doc) == ["T", "Body"]


@pytest.mark.parametrize("name, text", [
    ("marker.html", "<p>Intro\n[2]\nmore</p>\n"),
    ("marker.vtt", "WEBVTT\n\n00:00:01.000 --> 00:00:02.000\nHi\n [1] \n"),
    ("marker.po", 'msgid "Intro\\n[3]\\nmore"\nmsgstr ""\n'),
])
def test_a_text_with_a_line_that_reads_as_a_piece_marker_is_refused(name, text):
    with pytest.raises(DocumentError) as err:
        read_document(name, text.encode(), max_chars=1000)
    assert str(err.value).startswith("a text holds a line that is only '[")
    assert "uses to mark its pieces" in str(err.value)
    # a bracketed number inside a line is text
    assert read_document(name, text.replace("[", "see [").encode(), max_chars=1000)


@pytest.mark.parametrize("text, reason", [
    ("Just words, no markup.\n", "not an HTML file: it holds no tag"),
    ("<p>Hello</p>\n<script>var a = 1;\n", "not a well-formed HTML file: the element whose content starts at line 2"),
    ("<p>Hello</p>\n<pre>code\n", "not a well-formed HTML file: the <pre> opened at line 2 is never closed"),
    ("<p>Hello</p>\n<div class=\"x\"\n", "not a well-formed HTML file: line 2: the file ends inside a tag"),
    ("<p>Hello</p><!-- no end\n", "not a well-formed HTML file: line 1: the file ends inside a tag or a comment"),
    ("<p> 2024 </p>\n", "the HTML file has no text outside markup"),
])
def test_a_malformed_html_file_is_refused_with_the_reason(text, reason):
    with pytest.raises(DocumentError) as err:
        read_document("bad.html", text.encode(), max_chars=1000)
    assert str(err.value).startswith(reason)


# ---------------------------------------------------------------------------- through the worker's steps

@pytest.mark.parametrize("name, text, reason", [
    ("broken.vtt", "1\n00:00:01.000 --> 00:00:02.000\nHi\n", "not a WebVTT (.vtt) file: the first line"),
    ("broken.pot", 'msgid "a"\nmsgstr "b\n', "not a gettext catalog (.po): line 2: expected a quoted string"),
    ("broken.html", "<p>Hello</p>\n<pre>code\n", "not a well-formed HTML file: the <pre> opened at line 2"),
])
def test_a_malformed_file_goes_to_failed_with_its_reason_and_nothing_else_changes(tmp_path, name, text, reason):
    p = Worker(tmp_path)
    (p.inbox / "keep.txt").write_text("Another file, not taken yet.\n")
    p.drop(name, text)
    assert p.sent == []
    assert (p.inbox / "failed" / name).read_text() == text  # moved as it was
    assert (p.inbox / "failed" / f"{name}.error.txt").read_text().startswith(reason)
    assert not (p.inbox / name).exists() and (p.inbox / "keep.txt").read_text() == "Another file, not taken yet.\n"
    assert list(p.outbox.iterdir()) == [] and list((p.inbox / "done").iterdir()) == []
    assert p.w.state.counts().get("working", 0) == 0


def test_a_catalog_in_another_language_goes_to_failed_with_its_reason(tmp_path):
    p = Worker(tmp_path)
    p.drop("ru.po", RU)
    assert p.sent == [] and (p.inbox / "failed" / "ru.po").read_text() == RU
    assert (p.inbox / "failed" / "ru.po.error.txt").read_text().startswith("the catalog is in ru (its header's")


def test_a_file_whose_outputs_are_those_of_a_file_being_translated_is_refused(tmp_path):
    p = Worker(tmp_path)
    p.drop("messages.po", PO)
    assert len(p.sent) == 1
    p.drop("messages.pot", PO)  # would write messages.de.po too
    assert len(p.sent) == 1
    assert (p.inbox / "failed" / "messages.pot").read_text() == PO
    assert (p.inbox / "failed" / "messages.pot.error.txt").read_text().startswith(
        "its translations (messages.de.po) would overwrite those of messages.po, which is being translated")
    while not (p.outbox / "messages.de.po").exists():  # the first goes on
        msg = p.sent[-1]
        chunk = msg.text[msg.text.index("\n\n[") + 2:]
        p.answer(msg, "\n\n".join(f"[{n}]\n{german(t)}" for n, t in answer_cues(chunk).items()))
    assert (p.inbox / "done" / "messages.po").read_text() == PO


def test_a_template_comes_out_as_a_catalog_once_every_chunk_is_answered(tmp_path):
    p = Worker(tmp_path)
    p.drop("messages.pot", PO)
    while not (p.outbox / "messages.de.po").exists():
        msg = p.sent[-1]
        chunk = msg.text[msg.text.index("\n\n[") + 2:]
        p.answer(msg, "\n\n".join(f"[{n}]\n{german(t)}" for n, t in answer_cues(chunk).items()))
    out = (p.outbox / "messages.de.po").read_text()
    assert 'msgstr "Hallo %(name)s, du hast %d Nachrichten"' in out and '"Language: de\\n"' in out
    assert (p.inbox / "done" / "messages.pot").read_text() == PO


# ---------------------------------------------------------------------------- end to end

pytestmark_e2e = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc and prctl")
ECHO = re.compile(r" \(history=\d+\)$")


def texts_of(parse, text: str) -> tuple[list[str], list[str], str]:
    units, tail = parse(text)
    return [u["before"] for u in units], [t for u in units for _, t in u["texts"]], tail


@pytestmark_e2e
def test_a_webvtt_file_comes_out_with_its_structure_and_translated_cues(tcast, pipe, start_runtime):
    from plugins_app.channel.workers.translate.documents import parse_vtt
    translate_plugin(pipe)
    start_runtime()
    pipe.drop("talk.vtt", VTT)
    de, fr = pipe.written("talk.de.vtt", "talk.fr.vtt")
    structure, cues, tail = texts_of(parse_vtt, VTT)
    for out, lang in ((de, "German (de)"), (fr, "French (fr)")):
        got_structure, got_cues, got_tail = texts_of(parse_vtt, out)
        assert got_structure == structure and got_tail == tail  # header, notes, ids, timings: as they were
        # the scripted engine echoes the instruction and the chunk: each cue's text is the source's
        assert [ECHO.sub("", c) for c in got_cues] == cues and f"into {lang}" not in "".join(got_cues)
        assert any(ECHO.search(c) for c in got_cues)  # the answers were written, not the source kept
    assert pipe.settled("talk.vtt")
    assert Receipt.objects.values("conversation").distinct().count() == 2


@pytestmark_e2e
def test_a_gettext_template_comes_out_as_a_catalog_per_language(tcast, pipe, start_runtime):
    translate_plugin(pipe)
    start_runtime()
    pipe.drop("messages.pot", PO)
    de, fr = pipe.written("messages.de.po", "messages.fr.po")
    for out, lang, forms in ((de, "de", "(n != 1)"), (fr, "fr", "(n > 1)")):
        assert f'"Language: {lang}\\n"' in out and f"plural={forms};" in out
        units, _tail = parse_po(out)
        # every entry that was sent is translated now: none is left to send
        assert [u for u in units if u["texts"]] == []
        assert 'msgctxt "menu"\nmsgid "File"\nmsgstr "Datei"' in out and '#~ msgid "Gone"' in out
        assert re.search(r'msgid "One file"\nmsgid_plural "%d files"\nmsgstr\[0\] "One file"\nmsgstr\[1\] "%d files',
                         out), out
    assert pipe.settled("messages.pot")
    assert wait_until(lambda: not (pipe.inbox / "messages.pot").exists(), 5)


@pytestmark_e2e
def test_an_html_page_comes_out_with_its_markup_unchanged(tcast, pipe, start_runtime):
    translate_plugin(pipe, to="de")
    start_runtime()
    pipe.drop("guide.html", HTML)
    [de] = pipe.written("guide.de.html")
    structure, texts, tail = texts_of(parse_html, HTML)
    got_structure, got_texts, got_tail = texts_of(parse_html, de)
    assert got_structure == structure and got_tail == tail
    assert [ECHO.sub("", t) for t in got_texts] == texts and any(ECHO.search(t) for t in got_texts)
    assert pipe.settled("guide.html")
