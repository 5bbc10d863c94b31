"""A chat summariser for a daemon's tests (UGENT_EXTRA_SUMMARIZERS="test-slow=tests.support.slow_summarizer:
SlowSummarizer"): it marks UGENT_TEST_SUMMARIZER_MARK when it starts, then takes UGENT_TEST_SUMMARIZER_SECS
(120 by default) before it answers: a model call slow enough to kill the process in the middle of."""
from __future__ import annotations

import os
import time
from pathlib import Path

from ovos_plugin_manager.templates.agents import ChatSummarizerEngine


class SlowSummarizer(ChatSummarizerEngine):
    def summarize(self, messages, lang=None):
        mark = os.environ.get("UGENT_TEST_SUMMARIZER_MARK")
        if mark:
            Path(mark).write_text(str(len(messages)))
        time.sleep(float(os.environ.get("UGENT_TEST_SUMMARIZER_SECS", "120")))
        return "- a summary the slow summariser finished"
