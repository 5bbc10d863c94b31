"""The worker SDK's log of the signatures a webhook took (plugins_app/channel/sdk/seen.py)."""
from __future__ import annotations

from plugins_app.channel.sdk.seen import AGAIN, NEW, OTHER, SeenLog


class Looked(dict):
    """A dict that counts the entries read through ``items()``."""

    looked = 0

    def items(self):
        for item in super().items():
            Looked.looked += 1
            yield item


def test_a_use_forgets_what_is_older_than_kept_reading_only_the_oldest_entries(tmp_path):
    """Every use read all the entries (an hour of a busy webhook's signatures: thousands) to find the dead ones;
    they are in the order they came, so it stops at the first one still kept."""
    now = [1000.0]
    log = SeenLog(str(tmp_path / "seen.log"), 1000, lambda: now[0])
    for i in range(500):
        now[0] += 1
        log.use(f"k{i}", b"d")
    log.entries = Looked(log.entries)
    now[0] += 551  # the first 50 are past the 1000 s kept
    Looked.looked = 0
    assert log.use("new", b"d") == NEW
    assert Looked.looked == 51 and len(log.entries) == 451 and "k49" not in log.entries and "k50" in log.entries
    assert (log.use("k50", b"d"), log.use("k50", b"e")) == (AGAIN, OTHER)
    log.close()
    again = SeenLog(str(tmp_path / "seen.log"), 1000, lambda: now[0])  # read back in the order written
    assert list(again.entries)[:2] == ["k50", "k51"] and list(again.entries)[-1] == "new"
    again.close()
