"""The events log survives a torn last line (a node crash or a full disk mid-write)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ftkit.events import EventLog, read_events

TORN = b'{"time": 17957902'  # what a writer killed mid-write leaves: no newline


def test_a_torn_last_line_costs_no_record_written_after_it(tmp_path: Path) -> None:
    """Another process appends after the torn line: its record is whole and read back, the
    torn one is skipped, and the file's other lines are untouched."""
    path = tmp_path / "events.jsonl"
    EventLog(path).emit("start", step=0)
    with open(path, "ab") as f:
        f.write(TORN)
    subprocess.run([sys.executable, "-c", "import sys; from ftkit.events import EventLog; "
                    "EventLog(sys.argv[1]).emit('start', step=60)", str(path)], check=True, timeout=60)
    EventLog(path).emit("exit", step=70)
    assert [(e["event"], e["step"]) for e in read_events(path)] == [("start", 0), ("start", 60), ("exit", 70)]
    lines = path.read_bytes().split(b"\n")
    assert lines[1] == TORN and json.loads(lines[2])["step"] == 60


def test_a_log_torn_before_finds_the_record_appended_to_the_torn_line(tmp_path: Path) -> None:
    """A log written by a writer that did not end torn lines: the record glued to the torn
    part is still read."""
    path = tmp_path / "events.jsonl"
    whole = json.dumps({"time": 1795790622.39, "event": "start", "step": 60}).encode()
    path.write_bytes(json.dumps({"time": 1.0, "event": "start", "step": 0}).encode() + b"\n" + TORN + whole + b"\n")
    assert [(e["event"], e["step"]) for e in read_events(path)] == [("start", 0), ("start", 60)]


def test_the_report_counts_the_run_after_a_torn_line(tmp_path: Path) -> None:
    """The user's path: a run, its log torn as a crash leaves it, a second run; ``ftkit report``
    shows both runs."""
    job = tmp_path / "job"

    def ftkit(*args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "ftkit", *args], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    ftkit("demo", "--jobdir", str(job), "--steps", "20", "--step-time", "0", "--save-every", "10", "--no-live")
    with open(job / "events.jsonl", "ab") as f:
        f.write(TORN)
    ftkit("demo", "--jobdir", str(job), "--steps", "30", "--step-time", "0", "--no-live")
    starts = [e for e in read_events(job / "events.jsonl") if e["event"] == "start"]
    assert len(starts) == 2
    said = ftkit("report", str(job), "--json")
    report = json.loads(said)
    assert len(report["runs"]) == 2, said


def test_a_full_disk_is_warned_once_per_streak_and_its_lost_records_counted(small_fs, caplog):
    """On a full disk every step's records fail to append: one warning, not one per record
    (the demo's last screen was mostly these), and a count once records are written again."""
    import logging

    from tests.conftest import fill_up

    log = EventLog(small_fs / "events.jsonl")
    log.emit("start")
    filler = fill_up(small_fs / "filler")
    with caplog.at_level(logging.DEBUG, logger="ftkit.events"):
        for step in range(5):
            log.emit("progress", step=step, pad="x" * 8192)
        said = [r for r in caplog.records if "could not append" in r.getMessage()]
        assert [r.levelno for r in said] == [logging.WARNING] + [logging.DEBUG] * 4, said
        assert "No space left on device" in said[0].getMessage()
        filler.unlink()
        log.emit("exit")
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING][-1] == (
        f"events log {small_fs / 'events.jsonl'} written again; 5 record(s) could not be written before")
    assert [e["event"] for e in read_events(small_fs / "events.jsonl")] == ["start", "exit"]
