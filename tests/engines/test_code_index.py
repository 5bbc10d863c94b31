"""The code-context RetrievalEngine (plugins_app/agent/engines/code.py): BM25 over a folder's source files,
chunked by symbol, confined to the folder (no symlink out is read), binary and large files skipped, and
re-indexed when a file changes."""
from __future__ import annotations

import os
import time

import pytest
from ovos_plugin_manager.templates.agents import RetrievalEngine

from plugins_app.agent.engines.code import WINDOW_LINES, CodeRetrievalEngine, chunk_file, code_terms

pytestmark = pytest.mark.mode_free  # engines and toolboxes in this process, no database, Redis or run mode

BILLING = '''import os


def parse_invoice(total):
    """Read an invoice's total."""
    return total * 2


class PaymentGateway:
    """Charges cards."""

    def charge(self, amount):
        return amount
'''

MAILER = '''export function sendEmail(recipient) {
  return smtp.deliver(recipient);
}

export class Mailbox {
  open() { return 1; }
}
'''


@pytest.fixture
def tree(tmp_path):
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    (ws / "pkg").mkdir(parents=True)
    outside.mkdir()
    (ws / "pkg" / "billing.py").write_text(BILLING)
    (ws / "web").mkdir()
    (ws / "web" / "mailer.js").write_text(MAILER)
    (ws / "notes.txt").write_text("\n".join(f"line {i} about nothing" for i in range(1, 101)) + "\n")
    (outside / "vault.py").write_text("def zebra_secret_token():\n    return 'outside'\n")
    os.symlink(outside, ws / "linked-folder")                    # a folder link out
    os.symlink(outside / "vault.py", ws / "pkg" / "vault.py")    # a file link out
    os.symlink(ws / "pkg" / "billing.py", ws / "same.py")        # a link that stays inside
    return ws, outside


def engine(ws, **config):
    return CodeRetrievalEngine({"root": str(ws), "rescan_interval": 0, **config})


def test_it_is_an_opm_retrieval_engine_returning_path_lines_and_score_pairs(tree):
    ws, _ = tree
    e = engine(ws)
    assert isinstance(e, RetrievalEngine)
    found = e.query("how does the payment gateway charge an amount?", k=2)
    assert found and all(isinstance(c, str) and isinstance(s, float) for c, s in found)
    content, score = found[0]
    assert content.split("\n")[0] in ("pkg/billing.py:9-13", "same.py:9-13")
    assert "def charge(self, amount):" in content and score > 0
    assert e.query("quantum chromodynamics") == []


def test_python_is_chunked_by_top_level_def_and_class():
    chunks = chunk_file("pkg/billing.py", BILLING)
    named = [(c.symbol, c.start, c.end) for c in chunks if c.symbol]
    assert named == [("parse_invoice", 4, 6), ("PaymentGateway", 9, 13)]


def test_a_long_python_class_is_chunked_by_method():
    body = "\n".join(f"    def m{i}(self):\n" + "\n".join(f"        x = {j}" for j in range(8)) for i in range(8))
    text = "class Big:\n    '''A big class.'''\n\n" + body + "\n"
    symbols = [c.symbol for c in chunk_file("big.py", text)]
    assert symbols[0] == "Big" and symbols[1:] == [f"Big.m{i}" for i in range(8)]


def test_other_languages_by_their_symbol_lines_and_prose_in_line_windows(tree):
    ws, _ = tree
    js = chunk_file("web/mailer.js", MAILER)
    assert [(c.start, c.end) for c in js] == [(1, 3), (5, 7)]
    prose = chunk_file("notes.txt", (ws / "notes.txt").read_text())
    assert [(c.start, c.end) for c in prose] == [(1, WINDOW_LINES), (WINDOW_LINES + 1, 2 * WINDOW_LINES),
                                                 (2 * WINDOW_LINES + 1, 100)]
    hits = engine(ws).query_chunks("send an email to the recipient", k=1)
    assert hits[0].chunk.where == "web/mailer.js:1-3"


def test_identifiers_are_searched_whole_and_by_their_parts():
    terms = code_terms("sendEmail parse_invoice HTTPServer")
    assert {"sendemail", "send", "email"} <= set(terms)
    assert {"http", "server"} <= set(terms)
    assert "invoic" in terms and "pars" in terms


def test_a_symlink_out_of_the_folder_is_never_read(tree):
    ws, _ = tree
    e = engine(ws)
    assert e.query("zebra secret token", k=5) == []
    paths = {c.path for c in e.refresh().chunks}
    assert "pkg/vault.py" not in paths and not any(p.startswith("linked-folder") for p in paths)
    assert "same.py" in paths  # a link that stays inside is read


def test_binary_large_and_hidden_files_are_skipped(tree):
    ws, _ = tree
    (ws / "blob.py").write_bytes(b"def invoice_blob():\x00\x01\x02 binary")
    (ws / "huge.py").write_text("def invoice_huge():\n" + "    x = 1\n" * 5000)
    (ws / ".hidden").mkdir()
    (ws / ".hidden" / "h.py").write_text("def invoice_hidden():\n    pass\n")
    paths = {c.path for c in engine(ws, max_file_bytes=16 * 1024).refresh().chunks}
    assert {"blob.py", "huge.py", ".hidden/h.py"}.isdisjoint(paths)
    assert "pkg/billing.py" in paths
    assert "huge.py" in {c.path for c in engine(ws, max_file_bytes=1024 * 1024).refresh().chunks}


def test_the_index_follows_edits_new_and_removed_files_and_is_not_rebuilt_otherwise(tree):
    ws, _ = tree
    e = engine(ws)
    assert e.query("refund policy") == []
    builds = e.builds
    e.query("payment")
    assert e.builds == builds  # nothing changed: the same index
    (ws / "pkg" / "refunds.py").write_text("def refund_policy():\n    return 'thirty days'\n")
    assert e.query("refund policy")[0][0].startswith("pkg/refunds.py:1-2")
    path = ws / "pkg" / "refunds.py"
    path.write_text("def refund_window():\n    return 'ninety days'\n")
    os.utime(path, ns=(path.stat().st_mtime_ns + 10**9,) * 2)  # a later mtime, as a real edit has
    assert "ninety" in e.query("refund window")[0][0]
    path.unlink()
    assert e.query("refund window") == []


def test_a_query_never_waits_for_a_rescan_it_starts_one_in_the_background(tree, monkeypatch):
    """Past rescan_interval a query answers from the index it has while a thread of its own walks the
    folder (here held until released); the rebuild lands for the next query. A query that had to wait
    for the walk would never come back while the walk is held."""
    import threading

    from plugins_app.agent.engines import code
    ws, _ = tree
    e = CodeRetrievalEngine({"root": str(ws), "rescan_interval": 0.05})
    assert e.query_chunks("billing invoice") and e.builds == 1  # the first build is the query's own
    (ws / "pkg" / "ledger.py").write_text("def ledger_reconcile():\n    return 'reconciled ledger'\n")
    walking, release = threading.Event(), threading.Event()
    real = code.folder_files

    def held(*args, **kwargs):
        walking.set()
        assert release.wait(30)
        return real(*args, **kwargs)
    monkeypatch.setattr(code, "folder_files", held)
    time.sleep(0.06)  # past the interval
    answered = []
    querying = threading.Thread(target=lambda: answered.append(e.query_chunks("ledger reconcile")))
    querying.start()
    querying.join(10)
    assert not querying.is_alive(), "the query waited for the walk"
    assert answered == [[]]  # the index it had knows no ledger yet
    assert walking.wait(10)  # a look started, in another thread
    assert e.query_chunks("ledger reconcile") == [] and e.builds == 1  # one look at a time: no second
    release.set()
    assert e.wait_idle(30)
    assert e.builds == 2
    assert [h.chunk.path for h in e.query_chunks("ledger reconcile")] == ["pkg/ledger.py"]


def test_a_failed_background_look_keeps_the_index_and_the_next_interval_looks_again(tree, monkeypatch, caplog):
    from plugins_app.agent.engines import code
    ws, _ = tree
    e = CodeRetrievalEngine({"root": str(ws), "rescan_interval": 0.05})
    assert e.query_chunks("billing invoice")
    real = code.folder_files
    monkeypatch.setattr(code, "folder_files", lambda *a, **k: (_ for _ in ()).throw(OSError("disk gone")))
    time.sleep(0.06)
    assert e.query_chunks("billing invoice")  # answered from the index in hand
    assert e.wait_idle(30)
    assert "looking at" in caplog.text and "disk gone" in caplog.text
    monkeypatch.setattr(code, "folder_files", real)
    (ws / "pkg" / "ledger.py").write_text("def ledger_reconcile():\n    return 1\n")
    time.sleep(0.06)
    e.query_chunks("ledger")
    assert e.wait_idle(30)
    assert [h.chunk.path for h in e.query_chunks("ledger reconcile")] == ["pkg/ledger.py"]
