"""The translation channel: a directory pipeline. Files dropped in an inbox come out translated in an outbox.

    python -m plugins_app.channel.workers.translate --inbox DIR --outbox DIR --to de,fr
        [--from en] [--glossary FILE] [--max-chunk-chars 4000] [--settle-secs 2] [--max-attempts 3]
        [--max-file-bytes 5242880] [--sender pipeline] [--poll]

No platform and no credentials: the "channel" is two directories on the operator's disk. Operators'
page: docs/channels/translate.md.

* **Taking a file.** The inbox is watched (watchfiles), scanned every half settle interval (at
  least once a second: the settle check needs a second look) and at start, so files dropped while the worker was down
  are taken too. A file is taken once its size and modification time stayed the same for
  ``--settle-secs``; names starting with ``.`` or ending ``.part``/``.tmp`` are never taken (write
  under such a name, then rename: the rename is the drop). ``.txt``, ``.md``/``.markdown``,
  ``.srt``, ``.vtt``, ``.po``/``.pot`` and ``.html``/``.htm`` are read (``documents.py``, ``po.py``,
  ``markup.py``); anything else, a file that is not UTF-8, or one its format's parser cannot read
  for sure, goes to ``inbox/failed/`` with ``<name>.error.txt`` saying why.
* **Chunks in.** A document is cut at paragraphs (subtitles: at cues) into chunks of at most
  ``--max-chunk-chars``, and each chunk goes to the agent as an inbound message whose text is the
  instruction (translate into …, keep the markup, the answer only, the glossary's terms that occur)
  followed by the chunk. One conversation per document and language (``doc:<digest>:<lang>``), and
  the chunks of one go one after another, each once the one before was answered, so the engine sees
  the earlier parts. The message id is the content's digest, the language, the chunk's index and
  a digest of its instruction: a restart or the same file dropped again never runs a chunk twice.
* **Answers out.** Deliveries answering a chunk (``reply_to_message_id``) are recorded in the
  worker's state (``state.py``, a journal per document beside the outbox, each line fsynced) before they are acked.
  When every chunk of a document has its answer in every language, ``outbox/<stem>.<lang><suffix>``
  is written (a temporary file, fsync, ``os.replace``), and only then the source moves to
  ``inbox/done/``. A turn that failed or was interrupted is asked again (a new message id), up to
  ``--max-attempts``; a refused one, or one out of attempts, fails the document. A chunk with no answer
  ``--turn-timeout-secs`` after it was submitted is asked again too, unless the SDK's outbox says the
  hub refused it (the document fails) or has not taken it yet (it waits).
* **Other deliveries** (a question the agent asks, a question's notice, a message that answers no
  chunk) are acked and logged, never sent anywhere: nobody is there to answer, and the pipeline
  must not wedge on them. A question waits until it expires, and the turn then goes on.
"""
from __future__ import annotations

import argparse
import errno
import hashlib
import os
import secrets
import stat
import sys
import threading
import time
from pathlib import Path

from plugins_app.channel.sdk import ChannelRefused, ChannelWorker, InboundMessage, MessageValidationError
from plugins_app.channel.sdk.outbox import PENDING, REJECTED, outbox_path_for

from .documents import (LANG_TAG, Chunk, DocumentError, assemble, glossary_for, instruction, parse_glossary,
                        output_suffix, read_document, suffix_of)
from .state import ANSWERED, DONE, FAILED, NEW, REPLAN, SUBMITTED, SUPERSEDED, TranslateState

KIND = "channel-translate"
DESCRIPTION = "Translation: a directory pipeline; documents dropped in an inbox come out translated in an outbox."
ENV_REFS: tuple[str, ...] = ()

CHANNEL = "translate"
#: Names never taken from the inbox: hidden files and files still being written under a temporary name.
SKIPPED_PREFIXES = (".",)
SKIPPED_SUFFIXES = (".part", ".tmp", ".partial", ".crdownload", "~")
#: How often the pipeline looks for work when nothing woke it (an answer, a file taken).
PUMP_BACKSTOP_SECS = 5.0
#: A document whose step raises (its output cannot be written, done/ on another file system) is left
#: alone for this long, doubled each time up to 5 minutes, and failed after DOCUMENT_GIVE_UP steps in a
#: row; the other documents go on meanwhile.
DOCUMENT_BACKOFF_SECS = 2.0
DOCUMENT_GIVE_UP = 5
#: The longest file name (bytes) most file systems take; the names the worker makes from a dropped one
#: (the output's ".<lang>", ".error.txt", done/'s ".<timestamp>-<n>") must fit in it too.
NAME_MAX = 255
_STAMP_BYTES = len(".20260101T000000-99")
#: Turn outcomes worth asking again; any other (refused, cancelled) fails the document at once. (An
#: abandoned turn usually sends no delivery at all: --turn-timeout-secs catches it.)
RETRIED_STATES = ("failed", "interrupted", "abandoned")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="channel-translate", description=DESCRIPTION)
    p.add_argument("--inbox", default="", help="the directory documents are dropped in")
    p.add_argument("--outbox", default="", help="the directory translations are written to")
    p.add_argument("--to", default="", help="target languages, BCP 47 tags separated by commas (de,fr,pt-BR)")
    p.add_argument("--from", dest="source", default="", help="the source language (default: the engine detects it)")
    p.add_argument("--glossary", default="", help="a glossary file: 'term = translation' lines, [de] sections")
    p.add_argument("--max-chunk-chars", type=int, default=4000, help="the most characters one chunk holds")
    p.add_argument("--settle-secs", type=float, default=2.0,
                   help="how long a file's size and time must stay the same before it is taken")
    p.add_argument("--max-attempts", type=int, default=3, help="turns tried for one chunk before the document fails")
    p.add_argument("--turn-timeout-secs", type=float, default=900.0,
                   help="how long a submitted chunk waits for its answer before it is asked again")
    p.add_argument("--max-file-bytes", type=int, default=5 * 1024 * 1024, help="the largest file taken")
    p.add_argument("--sender", default="pipeline", help="the sender id of every message (actor translate:<id>)")
    p.add_argument("--poll", action="store_true", help="scan the inbox on a timer instead of watching it")
    return p.parse_args(argv)


def config_problem(opts: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, in the words the admin shows; None when they will do."""
    if not opts.inbox or not opts.outbox:
        return "--inbox and --outbox are required (the directories documents arrive in and leave by)"
    if not opts.to:
        return "--to is required: the target languages, such as --to de,fr"
    for tag in [t.strip() for t in opts.to.split(",")] + ([opts.source] if opts.source else []):
        if tag != "detect" and not LANG_TAG.match(tag):
            return f"{tag!r} is not a BCP 47 language tag (such as de, pt-BR, zh-Hant)"
    if opts.max_chunk_chars < 200:
        return "--max-chunk-chars must be at least 200"
    if opts.turn_timeout_secs <= 0:
        return "--turn-timeout-secs must be more than 0"
    if opts.max_attempts < 1:
        return "--max-attempts must be at least 1"
    if Path(opts.inbox).resolve() == Path(opts.outbox).resolve():
        return "--inbox and --outbox must be different directories"
    return None


def write_atomic(path: Path, text: str, *, dir_fd: int | None = None) -> None:
    """Write a file whole or not at all: a temporary file beside it, fsync, rename, fsync the directory.

    The temporary file has a short random name created with ``O_EXCL|O_NOFOLLOW`` (a file or a link
    planted at it is never written through), and is removed if anything fails. With ``dir_fd`` the file
    is ``path.name`` in that open directory (one that was opened refusing a symbolic link)."""
    own = dir_fd is None
    dfd = _open_dir(path.parent) if own else dir_fd
    tmp = None
    try:
        for _ in range(100):
            tmp = f".tr-{secrets.token_hex(6)}.tmp"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dfd)
                break
            except FileExistsError:
                tmp = None
        else:
            raise FileExistsError(f"no free temporary name in {path.parent}")
        try:
            with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
            tmp = None
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp, dir_fd=dfd)
                except OSError:
                    pass
        try:
            os.fsync(dfd)
        except OSError:
            pass
    finally:
        if own:
            os.close(dfd)


def _open_dir(path: Path, *, nofollow: bool = False, dir_fd: int | None = None) -> int:
    """An open directory; with ``nofollow``, a symbolic link at ``path`` is refused (ELOOP/ENOTDIR)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | (os.O_NOFOLLOW if nofollow else 0)
    return os.open(path, flags, dir_fd=dir_fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _exists(name: str, dir_fd: int) -> bool:
    try:
        os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


def error_name(name: str) -> str:
    """``<name>.error.txt``; for a name too long for that, its start, ``~`` and a digest of it."""
    full = f"{name}.error.txt"
    if len(os.fsencode(full)) <= NAME_MAX:
        return full
    tag = "~" + hashlib.sha256(os.fsencode(name)).hexdigest()[:12] + ".error.txt"
    head = name
    while len(os.fsencode(head + tag)) > NAME_MAX:
        head = head[:-1]
    return head + tag


def output_name(name: str, lang: str) -> str:
    """``guide.md`` into ``de`` is ``guide.de.md``; a template, ``messages.pot``, gives ``messages.de.po``."""
    suffix = suffix_of(name)
    stem = name[:len(name) - len(suffix)] if suffix else name
    return f"{stem}.{lang}{output_suffix(name)}"


def skipped(name: str) -> bool:
    return name.startswith(SKIPPED_PREFIXES) or name.lower().endswith(SKIPPED_SUFFIXES)


def shown(name: str) -> str:
    """A file name as it can be written anywhere: a name that is not UTF-8 (its bytes kept as surrogates by
    os.listdir) with those bytes as \\xNN."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


class TranslateWorker(ChannelWorker):
    kind = KIND
    version = "1.0.0"
    capabilities = ("text",)

    def __init__(self, *, argv: list[str] | None = None, **kwargs):
        super().__init__(**kwargs)
        self.opts = parse_args(sys.argv[1:] if argv is None else argv)
        self.langs = [t.strip() for t in self.opts.to.split(",") if t.strip()]
        self.source_lang = None if self.opts.source in ("", "detect") else self.opts.source
        self.inbox = Path(self.opts.inbox) if self.opts.inbox else Path(".")
        self.outdir = Path(self.opts.outbox) if self.opts.outbox else Path(".")
        self.glossary: dict[str, dict[str, str]] = {}
        self.state: TranslateState | None = None
        self._wake = threading.Event()
        self._pump_lock = threading.Lock()
        self._seen: dict[str, tuple[int, int, float]] = {}  # name -> (size, mtime_ns, unchanged since)
        self._taken: dict[str, tuple[int, int]] = {}        # name -> (size, mtime_ns) when taken
        self._trouble: dict[tuple[str, str], tuple[int, float]] = {}  # (digest, name) -> (errors, retry at)

    # ------------------------------------------------------------------ connect

    def connect(self) -> None:
        problem = config_problem(self.opts)
        if problem:
            raise ChannelRefused(problem)
        if self.opts.glossary:
            try:
                self.glossary = parse_glossary(Path(self.opts.glossary).read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, ValueError) as exc:
                raise ChannelRefused(f"--glossary {self.opts.glossary}: {exc}") from exc
        try:
            for d in (self.inbox, self.outdir, self.inbox / "done", self.inbox / "failed"):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ChannelRefused(f"cannot make the pipeline's directories: {exc}") from exc
        for sub in ("done", "failed"):
            st = os.lstat(self.inbox / sub)
            if not stat.S_ISDIR(st.st_mode):
                # whoever can write the inbox could point it anywhere the daemon can write
                raise ChannelRefused(f"{self.inbox / sub} is not a directory (a symbolic link?): the pipeline "
                                     "moves files into it; make it a plain directory")
        path = Path(str(outbox_path_for(self.plugin_id, self.state_dir)).replace(".outbox.sqlite3", ".translate"))
        self.state = TranslateState(path)
        self.log.info("translate: %s -> %s into %s (chunks of at most %d characters)", self.inbox, self.outdir,
                      ",".join(self.langs), self.opts.max_chunk_chars)

    def disconnect(self) -> None:
        with self._pump_lock:
            if self.state is not None:
                self.state.close()
                self.state = None

    def stats(self) -> dict:
        out = super().stats()
        if self.state is not None:
            try:
                out["translate"] = self.state.counts()
            except Exception:  # noqa: BLE001 - a heartbeat must not fail for its stats
                pass
        return out

    # ------------------------------------------------------------------ the inbox

    def listen(self, submit) -> None:
        pumper = threading.Thread(target=self._pump_loop, name="translate-pump", daemon=True)
        pumper.start()
        self._wake.set()
        try:
            self.scan()
            self._watch()
        finally:
            self._wake.set()
            pumper.join(self.drain_timeout_secs)

    def _watch(self) -> None:
        interval = max(0.05, min(self.opts.settle_secs / 2, 1.0))
        if not self.opts.poll:
            try:
                import watchfiles
                self.log.info("translate: watching %s", self.inbox)
                for _changes in watchfiles.watch(self.inbox, stop_event=self.stopping, rust_timeout=int(interval * 1000),
                                                 yield_on_timeout=True, debounce=50, step=20, recursive=False,
                                                 watch_filter=None, raise_interrupt=False):
                    self.scan()
                return
            except Exception as exc:  # noqa: BLE001 - out of inotify watches, a file system it cannot watch
                if self.stopping.is_set():
                    return
                self.log.warning("translate: cannot watch %s (%s); scanning it every %.2f s", self.inbox, exc,
                                 interval)
        while not self.stopping.wait(interval):
            self.scan()

    def scan(self) -> None:
        """One look at the inbox: each file whose size and time held for the settle interval is taken."""
        now = time.monotonic()
        present = set()
        try:
            entries = list(os.scandir(self.inbox))
        except OSError as exc:
            self.log.error("translate: cannot read the inbox %s: %s", self.inbox, exc)
            return
        for entry in sorted(entries, key=lambda e: e.name):
            if skipped(entry.name):
                continue
            try:
                if entry.is_symlink():
                    self._refuse_link(entry.name)
                    continue
                if not entry.is_file(follow_symlinks=False):
                    continue  # a directory (done/, failed/), a FIFO, a socket: never read
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            present.add(entry.name)
            key = (st.st_size, st.st_mtime_ns)
            if self._taken.get(entry.name) == key:
                continue
            seen = self._seen.get(entry.name)
            if seen is None or seen[:2] != key:
                self._seen[entry.name] = (*key, now)
                continue
            if now - seen[2] < self.opts.settle_secs:
                continue
            try:
                self.take(entry.name, key)
            except Exception:  # noqa: BLE001 - one bad file must not stop the pipeline
                self.log.exception("translate: taking %s failed; it is tried again", shown(entry.name))
                self._seen.pop(entry.name, None)
        for name in list(self._seen):
            if name not in present:
                del self._seen[name]
        for name in list(self._taken):
            if name not in present:
                del self._taken[name]

    def _refuse_link(self, name: str) -> None:
        """A symbolic link in the inbox is never followed (it could point at the daemon's secrets): the link
        itself goes to failed/."""
        try:
            self.fail_file(name, "a symbolic link: only regular files are read; copy the file into the inbox")
        except Exception:  # noqa: BLE001 - one bad entry must not stop the scan
            self.log.exception("translate: cannot move the symbolic link %s to failed/", shown(name))

    def _read_regular(self, name: str, key: tuple[int, int]) -> bytes | None:
        """The bytes of inbox/<name> if it is still the regular file of this size and time (never through a
        symbolic link, never more than --max-file-bytes); None when it changed or is no regular file now."""
        fd = os.open(self.inbox / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or (st.st_size, st.st_mtime_ns) != key:
                return None
            limit, chunks, size = self.opts.max_file_bytes + 1, [], 0
            while size < limit:
                block = os.read(fd, min(1 << 20, limit - size))
                if not block:
                    break
                chunks.append(block)
                size += len(block)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def take(self, name: str, key: tuple[int, int]) -> None:
        """Read one settled file and record it with its chunks; a file that cannot be translated goes to failed/."""
        if key[0] > self.opts.max_file_bytes:
            self.fail_file(name, f"the file is {key[0]} bytes, over --max-file-bytes ({self.opts.max_file_bytes})")
            return
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            # the state, the messages and the logs all need text: such a name could never be recorded
            self.fail_file(name, "the name is not valid UTF-8 (" + shown(name)
                           + "): rename the file with a UTF-8 name")
            return
        longest = NAME_MAX - max(_STAMP_BYTES, len(".error.txt"), *(1 + len(lang) for lang in self.langs))
        if len(os.fsencode(name)) > longest:
            self.fail_file(name, f"the name is {len(os.fsencode(name))} bytes long: names of at most {longest} "
                                 "bytes are taken (the outputs add the language to it); rename it shorter")
            return
        clash = self._output_clash(name)
        if clash:
            self.fail_file(name, clash)
            self._taken[name] = key
            return
        try:
            data = self._read_regular(name, key)
        except PermissionError as exc:
            self.fail_file(name, f"cannot read the file: {exc.strerror} (the daemon's user needs read access)")
            return
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # became a symbolic link since the scan
                self._refuse_link(name)
                return
            raise
        if data is None or len(data) != key[0]:
            self._seen.pop(name, None)  # changed under us: it was not settled after all
            return
        digest = hashlib.sha256(data).hexdigest()
        try:
            doc = read_document(name, data, max_chars=self.opts.max_chunk_chars, langs=self.langs)
        except DocumentError as exc:
            self.fail_file(name, str(exc))
            self._taken[name] = key
            return
        chunks = {}
        for lang in self.langs:
            chunks[lang] = [
                (instruction(c, form=doc.form, lang=lang, source_lang=self.source_lang, name=name, index=i,
                             total=len(doc.chunks), glossary=glossary_for(self.glossary, lang, c.text)), c.to_dict())
                for i, c in enumerate(doc.chunks)]
        with self._pump_lock:
            if self.state is None:
                return
            self.state.take(digest=digest, name=name, form=doc.form, trailing_newline=doc.trailing_newline,
                            chunks=chunks, stale_before=time.time() - self.opts.turn_timeout_secs)
        self._taken[name] = key
        self.log.info("translate: took %s (%d chunks, sha256 %s) into %s", name, len(doc.chunks), digest[:12],
                      ",".join(self.langs))
        self._wake.set()

    def _output_clash(self, name: str) -> str | None:
        """Why a file is refused whose outputs are another's, being translated (``app.po`` and ``app.pot``
        both give ``app.de.po``): the later would overwrite the earlier. None when there is no such file."""
        mine = {output_name(name, lang) for lang in self.langs}
        for other in self.state.working() if self.state is not None else []:
            if other.name != name and mine & {output_name(other.name, lang) for lang in other.langs}:
                return (f"its translations ({', '.join(sorted(mine))}) would overwrite those of {other.name}, "
                        f"which is being translated: rename it, or drop it again once {other.name} is done")
        return None

    def fail_file(self, name: str, reason: str, digest: str | None = None) -> None:
        """Move a file to inbox/failed/ with ``<name>.error.txt`` beside it saying why. The reason is written
        first: a crash between the two leaves the file in the inbox, to fail again with the same words."""
        fd = self._subdir("failed")
        try:
            write_atomic(Path(error_name(name)), reason.rstrip("\n") + "\n", dir_fd=fd)
            self._move(name, fd, digest)
        finally:
            os.close(fd)
        self.log.warning("translate: %s failed: %s", shown(name), reason)

    def _subdir(self, sub: str) -> int:
        """inbox/done or inbox/failed, open; made if missing; a symbolic link there is refused (OSError)."""
        try:
            return _open_dir(self.inbox / sub, nofollow=True)
        except FileNotFoundError:
            os.mkdir(self.inbox / sub)
            return _open_dir(self.inbox / sub, nofollow=True)

    def _move(self, name: str, to_fd: int, digest: str | None) -> None:
        """Move inbox/<name> into the open directory ``to_fd`` if it is still the content ``digest`` names
        (a file edited in the meantime is a new drop and stays). The file is renamed as it is (a symbolic
        link stays a link); a name already taken there gets a timestamp (and a number) instead."""
        inbox = _open_dir(self.inbox)
        try:
            try:
                if digest is not None and self._digest_of(name, inbox) != digest:
                    return
                dest = name
                if _exists(dest, to_fd):
                    suffix = suffix_of(name)
                    stem = name[:len(name) - len(suffix)] if suffix else name
                    stamp = time.strftime('%Y%m%dT%H%M%S')
                    dest = f"{stem}.{stamp}{suffix}"
                    n = 1
                    while _exists(dest, to_fd):
                        n += 1
                        dest = f"{stem}.{stamp}-{n}{suffix}"
                os.replace(name, dest, src_dir_fd=inbox, dst_dir_fd=to_fd)
            except FileNotFoundError:
                return
            try:
                os.fsync(to_fd)
            except OSError:
                pass
        finally:
            os.close(inbox)
        self._taken.pop(name, None)
        self._seen.pop(name, None)

    def _digest_of(self, name: str, inbox_fd: int) -> str | None:
        """The SHA-256 of inbox/<name> read in blocks (None past --max-file-bytes or for a non-regular file)."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=inbox_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return None
            raise
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            h, size = hashlib.sha256(), 0
            while block := os.read(fd, 1 << 20):
                size += len(block)
                if size > self.opts.max_file_bytes:
                    return None
                h.update(block)
            return h.hexdigest()
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ the pipeline

    def _pump_loop(self) -> None:
        while not self.stopping.is_set():
            self._wake.wait(PUMP_BACKSTOP_SECS)
            self._wake.clear()
            if self.stopping.is_set():
                return
            try:
                self.pump()
            except Exception:  # noqa: BLE001 - the next wake tries again
                self.log.exception("translate: a pipeline step failed")

    def pump(self) -> None:
        """One step of every document at work: submit the next chunk of each language, finish a document
        whose every chunk is answered, fail one that cannot be."""
        with self._pump_lock:
            if self.state is None:
                return
            now = time.monotonic()
            for doc in self.state.working():
                key = (doc.digest, doc.name)
                trouble = self._trouble.get(key)
                if trouble is not None and now < trouble[1]:
                    continue  # backing off; the others go on
                try:
                    self._pump_document(doc)
                except Exception as exc:  # noqa: BLE001 - one document must not hold up the others
                    errors = (trouble[0] if trouble else 0) + 1
                    if errors < DOCUMENT_GIVE_UP:
                        wait = min(300.0, DOCUMENT_BACKOFF_SECS * 2 ** (errors - 1))
                        self._trouble[key] = (errors, now + wait)
                        self.log.exception("translate: %s: a step failed (%d in a row); tried again in %g s",
                                           doc.name, errors, wait)
                        continue
                    self._trouble.pop(key, None)
                    self.log.exception("translate: %s: a step failed %d times in a row; giving up", doc.name, errors)
                    self._give_up(doc, f"cannot finish the document: {exc}")
                else:
                    self._trouble.pop(key, None)

    def _give_up(self, doc, reason: str) -> None:
        try:
            self.fail_document(doc, reason)
        except Exception:  # noqa: BLE001 - the file cannot even be moved: settle it so it stops holding the pump
            self.log.exception("translate: %s: cannot move it to failed/ either; it stays in the inbox", doc.name)
            self.state.settle(doc.digest, doc.name, FAILED, reason)

    def _pump_document(self, doc) -> None:
        if self.state.superseded(doc):
            # the file was replaced while at work: the newer content's translation is the one written
            self.log.warning("translate: %s (sha256 %s) was replaced by a newer file of that name: its "
                             "translation is dropped", doc.name, doc.digest[:12])
            self.state.settle(doc.digest, doc.name, SUPERSEDED, "a newer file of that name was taken")
            return
        lost = self.state.plan_lost(doc)
        if lost:
            # never "complete" with no chunks: the file is taken again (a new plan) if it is still there
            self.log.error("translate: %s: the plan for %s was lost (a crash while it was taken); taking the "
                           "file again", doc.name, ",".join(lost))
            self.state.settle(doc.digest, doc.name, REPLAN, f"the plan for {','.join(lost)} was lost")
            self._taken.pop(doc.name, None)
            self._seen.pop(doc.name, None)
            return
        complete = True
        for lang in doc.langs:
            rows = self.state.chunks(doc.digest, lang)
            gone = next((r for r in rows if r.state == FAILED), None)
            if gone is not None:
                self.fail_document(doc, f"chunk {gone.index + 1} of {gone.total} into {lang}: {gone.reason}")
                return
            waiting = next((r for r in rows if r.state != ANSWERED), None)
            if waiting is None:
                continue
            complete = False
            if waiting.state == SUBMITTED and self._stale(waiting):
                waiting = self.state.chunks(doc.digest, lang)[waiting.index]
                if waiting.state == FAILED:
                    self.fail_document(doc, f"chunk {waiting.index + 1} of {waiting.total} into {lang}: "
                                            f"{waiting.reason}")
                    return
            if waiting.state == NEW and not self._submit_chunk(doc, waiting):
                return
        if complete:
            self.finish(doc)

    def _stale(self, row) -> bool:
        """A chunk submitted longer than --turn-timeout-secs ago with no answer: what became of it? Still
        pending in the SDK's outbox (the hub not reached): it waits. Refused by the hub when the SDK
        replayed it: the chunk fails. Taken but never answered (a turn abandoned with nothing to say, a
        delivery dead-lettered): asked again under a new message id, within --max-attempts. True when
        the chunk changed."""
        if row.submitted_at is None or time.time() - row.submitted_at < self.opts.turn_timeout_secs:
            return False
        outbox = self.outbox
        sdk = outbox.inbound_get(f"{row.conversation_id}\x1f{row.message_id}") if outbox is not None else None
        if sdk is not None and sdk.state == PENDING:
            return False
        result = (sdk.result or {}) if sdk is not None else {}
        if sdk is not None and (sdk.state == REJECTED or result.get("accepted") is False):
            reason = f"the hub refused it: {result.get('reason') or 'no reason given'}"
            self.state.turn_failed(row, reason, max_attempts=0)
        else:
            reason = f"no answer within --turn-timeout-secs ({self.opts.turn_timeout_secs:g} s)"
            self.state.turn_failed(row, reason, max_attempts=self.opts.max_attempts)
        self.log.warning("translate: chunk %d of %s into %s: %s", row.index + 1, row.digest[:12], row.lang, reason)
        return True

    def _submit_chunk(self, doc, row) -> bool:
        msg = InboundMessage(
            channel=CHANNEL, conversation_id=row.conversation_id, message_id=row.message_id,
            sender_id=self.opts.sender, sender_name="translation pipeline", source_type="user", text=row.prompt,
            metadata={"document": doc.name, "sha256": doc.digest, "lang": row.lang, "chunk": row.index + 1,
                      "chunks": row.total, "attempt": row.attempt})
        try:
            result = self.submit(msg)
        except MessageValidationError as exc:
            reason = f"chunk {row.index + 1} into {row.lang} is not a message the hub takes: {exc}"
            self.state.turn_failed(row, reason, max_attempts=0)
            self.fail_document(doc, reason)
            return False
        if not result.accepted and not result.queued:
            # The chunk fails, not just the document: the SDK's outbox keeps the refusal under this message
            # id (and the hub would answer it as a duplicate), so a re-drop must ask under a new one (.tryN).
            reason = (f"the hub refused chunk {row.index + 1} of {row.total} into {row.lang}: "
                      f"{result.reason or 'no reason given'}")
            self.state.turn_failed(row, reason, max_attempts=0)
            self.fail_document(doc, reason)
            return False
        self.state.submitted(row)
        return True

    def finish(self, doc) -> None:
        """Write each language's translation whole, then move the source to done/, then say so."""
        for lang in doc.langs:
            rows = self.state.chunks(doc.digest, lang)
            missing: list[int] = []
            notes: list[str] = []
            text = assemble(doc.form, [Chunk.from_dict(r.source) for r in rows], [r.answer or "" for r in rows],
                            trailing_newline=doc.trailing_newline, missing=missing, lang=lang, notes=notes)
            if missing:
                self.log.warning("translate: %s into %s: the answers left out pieces %s; they keep their source "
                                 "text", doc.name, lang, ", ".join(map(str, missing)))
            for note in notes:
                self.log.warning("translate: %s into %s: %s", doc.name, lang, note)
            write_atomic(self.outdir / output_name(doc.name, lang), text)
        fd = self._subdir("done")
        try:
            self._move(doc.name, fd, doc.digest)
        finally:
            os.close(fd)
        self.state.settle(doc.digest, doc.name, DONE)
        self.log.info("translate: %s done: %s", doc.name,
                      ", ".join(output_name(doc.name, lang) for lang in doc.langs))

    def fail_document(self, doc, reason: str) -> None:
        self.fail_file(doc.name, reason, doc.digest)
        self.state.settle(doc.digest, doc.name, FAILED, reason)

    # ------------------------------------------------------------------ deliveries

    def deliver(self, delivery) -> str | None:
        """Record an answer to a chunk (and wake the pipeline); ack anything else without sending it."""
        meta = delivery.metadata or {}
        kind = meta.get("kind")
        if kind == "question":
            self.log.warning("translate: the agent asked a question in %s (%r); nobody answers questions in this "
                             "pipeline: it waits until it expires (%s), then the turn goes on",
                             delivery.conversation_id, delivery.text[:200], meta.get("timeout_at"))
            return None
        if kind == "question_notice":
            self.log.info("translate: question notice in %s: %s", delivery.conversation_id, delivery.text[:200])
            return None
        with self._pump_lock:
            if self.state is None:
                raise RuntimeError("the worker is stopping")
            row = self.state.chunk_of(delivery.conversation_id, delivery.reply_to_message_id)
            if row is None:
                self.log.warning("translate: delivery %s in %s answers no chunk at work (reply to %s): dropped",
                                 delivery.delivery_id, delivery.conversation_id, delivery.reply_to_message_id)
                return None
            outcome = meta.get("state") or "completed"
            if outcome == "completed" and delivery.text.strip():
                if not self.state.answered(row, delivery.text):
                    self.log.info("translate: chunk %s answered again; the first answer stands", row.message_id)
            else:
                reason = f"the agent's turn ended {outcome}: {delivery.text.strip()[:300]}"
                gave_up = self.state.turn_failed(row, reason, max_attempts=self.opts.max_attempts
                                                 if outcome in RETRIED_STATES else 0)
                self.log.warning("translate: chunk %d of %s into %s: %s (%s)", row.index + 1, row.digest[:12],
                                 row.lang, reason, "giving up" if gave_up else "asking again")
        self._wake.set()
        return None


def main(argv: list[str] | None = None) -> None:
    TranslateWorker.main(argv=argv)
