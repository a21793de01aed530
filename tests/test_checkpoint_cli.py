"""``ftkit ls / verify / pin / unpin`` as real subprocesses, and without importing torch."""

from __future__ import annotations

import json
import subprocess
import sys

from ftkit.events import read_events
from tests.ckpt_helpers import REPO, env, make_mgr, small_state


def ftkit(*args: str, columns: int = 200) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ftkit", *args],
        env=env(COLUMNS=str(columns)),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _job(tmp_path):
    job = tmp_path / "job"
    mgr = make_mgr(job / "checkpoints", keep_last=None)
    for step in (1, 2, 3):
        mgr.save(step, small_state(step))
    (job / "checkpoints" / "step-00000004").mkdir()
    (job / "checkpoints" / "step-00000004" / "checkpoint-is-incomplete").touch()
    return job


def test_ls_json(tmp_path):
    job = _job(tmp_path)
    r = ftkit("ls", str(job), "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(x["step"], x["status"]) for x in rows] == [
        (4, "incomplete"),
        (3, "valid"),
        (2, "valid"),
        (1, "valid"),
    ]
    assert (
        "checkpoint-is-incomplete" in rows[0]["reason"]
        and rows[1]["size"] > 0
        and rows[1]["age_s"] >= 0
    )
    table = ftkit("ls", str(job))
    assert table.returncode == 0 and "incomplete" in table.stdout and "valid" in table.stdout


def test_a_long_reason_is_shown_whole_in_a_narrow_terminal(tmp_path):
    """An 80-column terminal: the "why" of ``ls``, ``verify`` and ``status`` (a switch's path
    in a reason) folds onto more lines instead of being cut short with an ellipsis."""
    job = tmp_path / "job"
    switch = "/scratch/users/someone/projects/llm-pretrain/ftkit-jobs/run-2026-11-27/save-switch"
    make_mgr(job / "checkpoints").save(5, small_state(5), reason=f"save-switch touched ({switch})")
    for command in ("ls", "verify", "status"):
        out = ftkit(command, str(job), columns=80).stdout
        assert "\u2026" not in out, out  # rich's ellipsis
        assert max(len(line) for line in out.splitlines() if "\u2502" in line) <= 80, out  # the table's rows
        cells = "".join(ch for ch in out if ch not in " \n\u2502")  # the column's lines, joined back
        assert f"save-switchtouched({switch})" in cells, out


def test_verify_exit_codes(tmp_path):
    job = _job(tmp_path)
    step3 = job / "checkpoints" / "step-00000003"
    assert ftkit("verify", str(step3)).returncode == 0
    # the incomplete step 4 (a save killed part-way) is no mismatch: resume passes over it,
    # retention removes it; said, not failed. Asked for by its step dir, it is not valid
    r = ftkit("verify", str(job))
    assert r.returncode == 0 and "all 3 complete checkpoint(s) valid; 1 incomplete" in " ".join(r.stdout.split()), r
    assert ftkit("verify", str(job / "checkpoints" / "step-00000004")).returncode == 3
    (job / "checkpoints" / "step-00000004" / "checkpoint-is-incomplete").unlink()
    (job / "checkpoints" / "step-00000004").rmdir()
    r = ftkit("verify", str(job))
    assert r.returncode == 0 and "all 3 checkpoint(s) valid" in r.stdout
    data = bytearray((step3 / "rank-00000.pt").read_bytes())
    data[100] ^= 1  # same size: only the checksum notices
    (step3 / "rank-00000.pt").write_bytes(bytes(data))
    r = ftkit("verify", str(step3), "--json")
    assert r.returncode == 3 and "checksum" in json.loads(r.stdout)[0]["reason"]
    assert ftkit("verify", str(job / "checkpoints")).returncode == 3
    assert ftkit("verify", str(tmp_path / "empty-nothing")).returncode != 0
    (tmp_path / "empty").mkdir()
    assert ftkit("verify", str(tmp_path / "empty")).returncode == 4
    only = tmp_path / "only-incomplete" / "checkpoints" / "step-00000001"
    only.mkdir(parents=True)
    (only / "checkpoint-is-incomplete").touch()
    r = ftkit("verify", str(only.parent))
    assert r.returncode == 3 and "no valid checkpoint; 1 incomplete" in " ".join(r.stderr.split()), r


def test_pin_unpin(tmp_path):
    job = _job(tmp_path)
    assert ftkit("pin", str(job), "2").returncode == 0
    assert (job / "checkpoints" / "step-00000002" / "pinned").exists()
    rows = json.loads(ftkit("ls", str(job), "--json").stdout)
    assert {x["step"]: x["pinned"] for x in rows} == {4: False, 3: False, 2: True, 1: False}
    # retention now keeps step 2 even with keep_last=1
    make_mgr(job / "checkpoints", keep_last=1).save(5, small_state(5))
    assert sorted(p.name for p in (job / "checkpoints").glob("step-*")) == [
        "step-00000002",
        "step-00000005",
    ]
    assert ftkit("unpin", str(job), "2").returncode == 0
    assert not (job / "checkpoints" / "step-00000002" / "pinned").exists()
    assert ftkit("pin", str(job), "99").returncode == 3
    again = ftkit("unpin", str(job), "2")  # not pinned (any more): said so, nothing recorded
    assert again.returncode == 0 and "step-00000002 was not pinned: nothing to do" in again.stdout
    assert ftkit("unpin", str(job), "99").returncode == 3
    assert [e["event"] for e in read_events(job / "events.jsonl")] == ["pin", "unpin"]
    # the events are there: asking for none of them shows none, and does not say there are none
    quiet = ftkit("status", str(job), "--events", "0")
    assert quiet.returncode == 0 and "no events yet" not in quiet.stdout and "recent events" not in quiet.stdout
    shown = ftkit("status", str(job)).stdout
    assert "recent events" in shown
    # the verdict comes from sizes alone: status says where the checksums are read
    assert "if the job dies now, it resumes from step 5" in shown and f"`ftkit verify {job}`" in shown


def test_cli_commands_do_not_import_torch(tmp_path):
    job = _job(tmp_path)
    code = (
        "import sys; from ftkit.cli import main; "
        f"rc = [main(['ls', {str(job)!r}, '--json']), main(['verify', {str(job / 'checkpoints' / 'step-00000001')!r}]),"
        " main(['--help']) if False else 0]; "
        "print('TORCH' if 'torch' in sys.modules else 'NOTORCH', rc)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        env=env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "NOTORCH [0, 0, 0]"
    h = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from ftkit.cli import build_parser; build_parser(); "
            "print('torch' in sys.modules)",
        ],
        env=env(),
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert h.stdout.strip() == "False"
