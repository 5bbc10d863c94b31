"""The order pytest-xdist hands the test files out in (`--dist loadfile`): the slowest first.

xdist's own order (`--loadscope-reorder`, its default) is by number of tests, most first: the end-to-end
files, one to five tests each but each test starting a daemon (10-45 s a file), were handed out last, and a
pass ended with one worker running the last of them while the others had nothing left. Longest first (LPT),
the files handed out last are the short ones and the workers end close together. The Makefile turns xdist's
order off (`--no-loadscope-reorder`) so that this one, the collection's, is kept.

`SECONDS` is what each of the slowest files took (the sum of its tests' durations, `--durations=0`, both
passes' larger figure, on the 2-core VM); a file not listed comes after them, most tests first, as xdist
would have put it. A stale figure costs only time: a new slow file belongs here, a file renamed or removed
leaves it (tests/test_workers.py checks each is there).
"""
from __future__ import annotations

from collections import Counter

#: tests/…py -> seconds (the files of 8 s or more, measured 2026-12-07 on the 2-core VM under a load of 4-7: the
#: embedded pass whole, the servers pass's end-to-end, streams, control room and cron files)
SECONDS: dict[str, float] = {
    "tests/e2e/test_memory_backfill_e2e.py": 103,
    "tests/plugins_app/test_channel_weixin.py": 83,
    "tests/plugins_app/test_sdk.py": 69,
    "tests/channels_app/test_turn_liveness.py": 87,
    "tests/plugins_app/test_channel_wechat.py": 75,
    "tests/e2e/test_channel_turn_killed.py": 65,
    "tests/e2e/test_layout.py": 67,
    "tests/plugins_app/test_channel_dingtalk.py": 63,
    "tests/plugins_app/test_mcp_toolbox.py": 61,
    "tests/plugins_app/test_channel_email.py": 59,
    "tests/plugins_app/test_channel_discord.py": 57,
    "tests/plugins_app/test_channel_listener_lanes.py": 55,
    "tests/plugins_app/test_channel_telegram.py": 54,
    "tests/plugins_app/test_channel_slack.py": 51,
    "tests/e2e/test_openai_client.py": 49,
    "tests/control_room/test_out_of_the_box.py": 48,
    "tests/plugins_app/test_channel_salesforce.py": 44,
    "tests/plugins_app/test_channel_whatsapp.py": 43,
    "tests/test_operator_key.py": 41,
    "tests/plugins_app/test_memory_recall.py": 38,
    "tests/plugins_app/test_channel_media_not_ready.py": 38,
    "tests/streams/test_event_stream.py": 34,
    "tests/plugins_app/test_memory_lance.py": 34,
    "tests/plugins_app/test_channel_wecom.py": 33,
    "tests/test_memstats.py": 33,
    "tests/plugins_app/test_channel_line.py": 32,
    "tests/plugins_app/test_channel_wecom_out.py": 32,
    "tests/control_room/test_browser_walk.py": 28,
    "tests/streams/test_live_daemon.py": 27,
    "tests/plugins_app/test_channel_translate.py": 23,
    "tests/e2e/test_control_room_live.py": 22,
    "tests/plugins_app/test_channel_email_gmail.py": 22,
    "tests/cron_app/test_cron_file_watch.py": 22,
    "tests/e2e/test_schemathesis.py": 20,
    "tests/engines/test_code_embeddings.py": 20,
    "tests/cron_app/test_cron_import_killed.py": 19,
    "tests/control_room/test_cron_run_killed.py": 19,
    "tests/cron_app/test_worker_servers.py": 19,
    "tests/plugins_app/test_django_supervisor.py": 18,
    "tests/engines/test_warm.py": 18,
    "tests/plugins_app/test_channel_dingtalk_files.py": 17,
    "tests/channels_app/test_files_daemon.py": 17,
    "tests/streams/test_compaction.py": 17,
    "tests/e2e/test_memory_extractor_e2e.py": 16,
    "tests/streams/test_fanout.py": 16,
    "tests/plugins_app/test_django_commands.py": 14,
    "tests/plugins_app/test_channel_weixin_parts.py": 14,
    "tests/channels_app/test_identity_tokens.py": 14,
    "tests/plugins_app/test_channel_dingtalk_parts.py": 14,
    "tests/channels_app/test_permissions.py": 13,
    "tests/e2e/test_artifacts_live.py": 13,
    "tests/rules_app/test_rule_index.py": 12,
    "tests/plugins_app/test_channel_wecom_out_parts.py": 12,
    "tests/channels_app/test_identity_roles.py": 12,
    "tests/plugins_app/test_channel_questions_workers.py": 12,
    "tests/e2e/test_cron_file_daemon.py": 12,
    "tests/e2e/test_background_queue.py": 11,
    "tests/streams/test_browser.py": 11,
    "tests/plugins_app/test_channel_email_parts.py": 10,
    "tests/plugins_app/test_memory_retention.py": 10,
    "tests/plugins_app/test_channel_salesforce_parts.py": 10,
    "tests/streams/test_snapshots.py": 10,
    "tests/rules_app/test_native_action_killed.py": 10,
    "tests/streams/test_memory_held.py": 9,
    "tests/test_logs.py": 9,
    "tests/channels_app/test_identity_config.py": 9,
    "tests/plugins_app/test_channel_line_worker.py": 9,
    "tests/channels_app/test_files_api.py": 8,
    "tests/plugins_app/test_channel_whatsapp_questions.py": 8,
}


def file_of(item) -> str:
    return item.nodeid.split("::", 1)[0]


def slowest_first(items: list) -> None:
    """Reorder `items` in place: files by SECONDS (largest first), then the rest by number of tests; each
    file's tests keep their order."""
    counts = Counter(file_of(item) for item in items)
    items.sort(key=lambda item: (-SECONDS.get(file_of(item), 0.0), -counts[file_of(item)], file_of(item)))
