"""A worker's log is bounded: the supervisor drains the worker's output through a pipe into
<plugin>.log, rotated to .log.1 … before it would pass the cap, and never stops draining."""
import sys
from pathlib import Path

import pytest

from plugins_app.channel.supervisor import DesiredWorker, Supervisor, SupervisionLimits, WorkerHandle, WorkerSpec
from plugins_app.channel.supervisor.process import LOG_BACKUPS, RotatingLog, read_log_tail

from .test_supervisor import wait_until

pytestmark = [pytest.mark.mode_free,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc and prctl")]

PY = sys.executable


@pytest.fixture(autouse=True)
def _eager_celery():
    # Overrides the shared conftest's fixture, which needs pytest-django (as test_supervisor.py does).
    yield

CAP = 64 * 1024
# 400,000 numbered lines (about 4.6 MB: far more than the cap and the 64 KiB of a pipe), then its last word.
CHATTY = ("-c", "import sys\n"
                "w = sys.stdout.write\n"
                "for i in range(400_000): w(f'line {i:07d}\\n')\n"
                "print('the last word', flush=True)\n")


def log_files(log_dir: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in log_dir.iterdir()}


def test_a_worker_writing_far_more_than_the_cap_leaves_no_file_over_it_and_its_newest_lines(tmp_path):
    handle = WorkerHandle.spawn(WorkerSpec("chatty", PY, CHATTY), log_dir=tmp_path, log_max_bytes=CAP)
    # It exits: nothing blocked it on a full pipe.
    assert wait_until(lambda: handle.poll() is not None, timeout=60)
    assert handle.returncode == 0
    sizes = log_files(tmp_path)
    assert set(sizes) == {"chatty.log", *(f"chatty.log.{n}" for n in range(1, LOG_BACKUPS + 1))}, sizes
    assert max(sizes.values()) <= CAP, sizes
    assert handle.log_path.read_text().splitlines()[-1] == "the last word"
    # The newest output is kept whole and in order across the rotated files.
    raw, cut = read_log_tail(handle.log_path, CAP * 2)
    lines = raw.decode().splitlines()[1:]  # the first may be cut by the window
    assert cut and lines[-1] == "the last word"
    assert lines[:-1] == [f"line {i:07d}" for i in range(400_000 - len(lines) + 1, 400_000)]


def test_the_supervisor_caps_its_workers_logs(tmp_path):
    once = SupervisionLimits(heartbeat_secs=0, backoff_initial_secs=60, stop_grace_secs=0.5)
    sup = Supervisor(lambda: [DesiredWorker(WorkerSpec("p1", PY, CHATTY), once)],
                     pid_dir=tmp_path / "pids", log_dir=tmp_path / "logs", log_max_bytes=CAP)
    try:
        def exited():
            sup.step()
            status = sup.status().get("p1")
            return status is not None and status.starts == 1 and status.pid is None
        assert wait_until(exited, timeout=60)
    finally:
        sup.shutdown(grace=0.5)
    sizes = log_files(tmp_path / "logs")
    assert max(sizes.values()) <= CAP and "p1.log.1" in sizes, sizes
    assert (tmp_path / "logs" / "p1.log").read_text().splitlines()[-1] == "the last word"


def test_a_log_the_disk_refuses_drops_output_but_the_worker_is_never_blocked(tmp_path):
    go = tmp_path / "go"
    waits = ("-c", f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.01)\n" + CHATTY[1])
    handle = WorkerHandle.spawn(WorkerSpec("refused", PY, waits), log_dir=tmp_path / "logs", log_max_bytes=CAP)
    # The log's place becomes a directory: every write and reopen fails from now on.
    handle.log_path.unlink()
    handle.log_path.mkdir()
    go.touch()
    assert wait_until(lambda: handle.poll() is not None, timeout=60)
    assert handle.returncode == 0


def test_a_write_larger_than_the_cap_keeps_its_end_and_a_bad_cap_is_refused(tmp_path):
    log = RotatingLog(tmp_path / "x.log", max_bytes=10)
    log.write(b"0123456789abcdef\n")
    log.close()
    assert (tmp_path / "x.log").read_bytes() == b"789abcdef\n"
    with pytest.raises(ValueError, match="at least 1"):
        RotatingLog(tmp_path / "y.log", max_bytes=0)
    assert not (tmp_path / "y.log").exists()


def test_the_tail_says_it_was_cut_only_when_older_bytes_exist(tmp_path):
    # a window the log fills exactly is the whole log: its first line is whole, and the admin keeps it
    log = tmp_path / "p.log"
    log.write_bytes(b"first\nsecond\n")
    assert read_log_tail(log, 13) == (b"first\nsecond\n", False)
    assert read_log_tail(log, 100) == (b"first\nsecond\n", False)
    assert read_log_tail(log, 7) == (b"second\n", True)
    (tmp_path / "p.log.1").write_bytes(b"older\n")
    assert read_log_tail(log, 13) == (b"first\nsecond\n", True)
    assert read_log_tail(log, 19) == (b"older\nfirst\nsecond\n", False)


def test_a_log_cap_below_one_byte_stops_the_start_in_one_line(tmp_path):
    import os
    import subprocess
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
    env.update(UGENT_PLUGIN_LOG_MAX_BYTES="0", UGENT_VAR_DIR=str(tmp_path))
    out = subprocess.run([PY, "manage.py", "check"], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "ugent.E002" in out.stderr and "UGENT_PLUGIN_LOG_MAX_BYTES is 0" in out.stderr, out.stderr
