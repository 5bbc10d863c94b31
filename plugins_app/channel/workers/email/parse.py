"""channel-email's pure parts: a fetched mail as an InboundMessage, threads, what is never answered, markup."""
from __future__ import annotations

import email
import email.policy
import email.utils
import re
from email.message import EmailMessage, Message
from html.parser import HTMLParser

from plugins_app.channel.sdk import Attachment, InboundMessage
from plugins_app.channel.sdk.messages import ReplyContext

CHANNEL = "email"
_MSGID = re.compile(r"<[^<>\s]+>")
_RETRY_IN = re.compile(r"(?:retry|try again)\D{0,20}?(\d+(?:\.\d+)?)\s*(?:s\b|sec|second)", re.I)
_QUOTE_INTRO = re.compile(r"^\s*(On .{3,200} wrote:|-----\s*Original Message\s*-----)\s*$", re.I)


def header_ids(value: str | None) -> list[str]:
    """The message ids (``<...>``) in a Message-ID/In-Reply-To/References header, in order."""
    return _MSGID.findall(str(value or ""))


def skip_reason(msg: Message, own_addresses: set[str]) -> str | None:
    """Why a message must not be answered (an auto-reply, a bounce, a list, our own), else None."""
    auto = str(msg.get("Auto-Submitted", "")).strip().lower()
    if auto and auto != "no":
        return f"Auto-Submitted: {auto}"
    precedence = str(msg.get("Precedence", "")).strip().lower()
    if precedence in ("bulk", "junk", "list", "auto_reply"):
        return f"Precedence: {precedence}"
    for name in ("X-Autoreply", "X-Autorespond"):
        if msg.get(name) is not None:
            return name
    return_path = msg.get("Return-Path")
    if return_path is not None and str(return_path).strip() in ("<>", ""):
        return "null Return-Path (a bounce)"
    sender = sender_address(msg)
    local = sender.split("@", 1)[0]
    if local in ("mailer-daemon", "postmaster", "mail-daemon"):
        return f"sender {sender}"
    if msg.get_content_type() == "multipart/report":
        return "multipart/report (a delivery report)"
    if sender and sender in own_addresses:
        return "our own mail"
    return None


def sender_address(msg: Message) -> str:
    """Who wrote it (From); Reply-To is only where an answer goes."""
    _, addr = email.utils.parseaddr(str(msg.get("From", "")))
    return addr.strip().lower()


def reply_address(msg: Message) -> str:
    _, addr = email.utils.parseaddr(str(msg.get("Reply-To") or msg.get("From") or ""))
    return addr.strip()


def recipients(msg: Message) -> set[str]:
    pairs = email.utils.getaddresses([str(v) for h in ("To", "Cc") for v in (msg.get_all(h) or [])])
    return {a.strip().lower() for _, a in pairs if a.strip()}


def thread_root(msg: Message, known: dict[str, str]) -> str:
    """The conversation of a message: the thread a known id in its headers names, else its root."""
    in_reply_to = header_ids(msg.get("In-Reply-To"))
    references = header_ids(msg.get("References"))
    for ref in list(reversed(in_reply_to)) + list(reversed(references)):
        if ref in known:
            return known[ref]
    if references:
        return references[0]
    if in_reply_to:
        return in_reply_to[0]
    own = header_ids(msg.get("Message-ID"))
    return own[0] if own else ""


def strip_quoted(text: str) -> str:
    """The new part of a reply: the trailing quote (``On ... wrote:`` and ``>`` lines) removed."""
    lines = text.replace("\r\n", "\n").split("\n")
    end = len(lines)
    while end and (not lines[end - 1].strip() or lines[end - 1].lstrip().startswith(">")):
        end -= 1
    if end < len(lines) and end and _QUOTE_INTRO.match(lines[end - 1]):
        end -= 1
    elif end == len(lines):
        for i, line in enumerate(lines):
            if _QUOTE_INTRO.match(line) and all(not l.strip() or l.lstrip().startswith(">") for l in lines[i + 1:]):
                end = i
                break
    kept = "\n".join(lines[:end]).strip()
    return kept or text.strip()


class _TextOfHtml(HTMLParser):
    _BLOCK = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "pre"}

    def __init__(self):
        super().__init__()
        self.out: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style", "head"):
            self._skip += 1
        elif tag in self._BLOCK:
            self.out.append("\n")

    def handle_endtag(self, tag):
        if tag in ("script", "style", "head"):
            self._skip = max(0, self._skip - 1)
        elif tag in self._BLOCK:
            self.out.append("\n")

    def handle_data(self, data):
        if not self._skip:
            self.out.append(data)


def html_to_text(markup: str) -> str:
    parser = _TextOfHtml()
    parser.feed(markup)
    parser.close()
    return re.sub(r"\n{3,}", "\n\n", "".join(parser.out)).strip()


def markdown_to_html(text: str) -> str:
    """The answer's Markdown as the HTML part (CommonMark and tables; raw HTML in the answer is escaped)."""
    from markdown_it import MarkdownIt
    md = MarkdownIt("commonmark", {"html": False, "linkify": False}).enable("table").enable("strikethrough")
    return f"<!DOCTYPE html>\n<html><body>\n{md.render(text)}</body></html>\n"


def body_text(msg: EmailMessage) -> str:
    part = msg.get_body(preferencelist=("plain", "html"))
    if part is None:
        return ""
    try:
        content = part.get_content()
    except (LookupError, UnicodeError):
        content = part.get_payload(decode=True).decode("utf-8", "replace")
    if part.get_content_type() == "text/html":
        content = html_to_text(content)
    return strip_quoted(content)


def attachment_kind(content_type: str) -> str:
    major = content_type.split("/", 1)[0].lower()
    return major if major in ("image", "audio", "video") else "document"


def attachment_parts(msg: EmailMessage) -> list[EmailMessage]:
    return [p for p in msg.iter_attachments() if not p.is_multipart()]


def imap_url(user: str, host: str, mailbox: str, uidvalidity: int, uid: int, index: int) -> str:
    """RFC 5092 IMAP URL of one attachment (``index`` counts the message's attachments from 1)."""
    from urllib.parse import quote
    return (f"imap://{quote(user, safe='')}@{host}/{quote(mailbox)};UIDVALIDITY={uidvalidity}"
            f"/;UID={uid}/;SECTION=ATTACHMENT.{index}")


_IMAP_URL = re.compile(r";UIDVALIDITY=(\d+)/;UID=(\d+)/;SECTION=ATTACHMENT\.(\d+)$")


def normalise(raw: bytes, *, uidvalidity: int, uid: int, own_addresses: set[str], known: dict[str, str],
              user: str, host: str, mailbox: str, gmail_id: str | None = None
              ) -> tuple[InboundMessage | None, EmailMessage, str | None]:
    """One fetched mail as an InboundMessage, or None with the reason it is not answered."""
    msg = email.message_from_bytes(raw, policy=email.policy.default)
    reason = skip_reason(msg, own_addresses)
    if reason:
        return None, msg, reason
    sender = sender_address(msg)
    if not sender:
        return None, msg, "no sender address"
    own_id = (header_ids(msg.get("Message-ID")) or [None])[0]
    fallback = f"gmail:{gmail_id}" if gmail_id else f"uid:{uidvalidity}:{uid}"
    message_id = short_id(own_id) if own_id else fallback
    conversation = short_id(thread_root(msg, known)) or message_id
    others = recipients(msg) - own_addresses - {sender}
    name, _ = email.utils.parseaddr(str(msg.get("From", "")))
    atts = []
    for i, part in enumerate(attachment_parts(msg), 1):
        ctype = part.get_content_type()
        atts.append(Attachment(kind=attachment_kind(ctype), content_type=ctype, filename=part.get_filename(),
                               url=f"gmail:{gmail_id}/{i}" if gmail_id
                               else imap_url(user, host, mailbox, uidvalidity, uid, i)))
    in_reply_to = header_ids(msg.get("In-Reply-To"))
    subject = str(msg.get("Subject", "") or "")
    text = body_text(msg) or subject.strip()  # the subject rides in metadata; it is the text only of an empty mail
    inbound = InboundMessage(
        channel=CHANNEL, conversation_id=conversation, message_id=message_id, sender_id=sender,
        sender_name=name or None, source_type="group" if others else "user", text=text, attachments=atts,
        reply_to=ReplyContext(in_reply_to[-1]) if in_reply_to else None,
        metadata={"subject": subject, **({"gmail_id": gmail_id} if gmail_id else
                                         {"uidvalidity": uidvalidity, "uid": uid})},
    )
    return inbound, msg, None


def short_id(value: str) -> str:
    """A Message-ID as an id the hub stores (255 characters at most): a longer one by its digest."""
    if len(value) <= 250:
        return value
    import hashlib
    return "sha256:" + hashlib.sha256(value.encode()).hexdigest()


def reply_subject(subject: str) -> str:
    subject = (subject or "").strip()
    return subject if re.match(r"^(re|aw|sv)\s*:", subject, re.I) else f"Re: {subject}".strip()


def retry_delay(message: str, attempt: int, first: float, cap: float) -> float:
    """The wait a transient SMTP reply asks for, else ``first`` doubled per attempt."""
    m = _RETRY_IN.search(message or "")
    if m:
        return min(float(m.group(1)), cap)
    return min(first * (2 ** attempt), cap)
