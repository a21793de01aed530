"""The crash-safe saver's one argument type: every CheckpointConfig field reaches the saver, and
``ftkit requeue`` reads a live saver's arguments back from /proc."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftkit.checkpoint import CheckpointConfig
from ftkit.checkpoint.crashsafe.args import SAVER_MODULE, SaverArgs
from ftkit.checkpoint.crashsafe.find import find_savers

# A value other than the default for every CheckpointConfig field. A field added to
# CheckpointConfig fails the first test until it gets one here, so the round trip covers it.
NOT_DEFAULT = {
    "root": Path("/scratch/run 7/ckpt"),
    "keep_last": 5,
    "keep_every": 1000,
    "resume": "required",
    "manager": "my_pkg.ckpt:Manager",
    "verify_on_load": False,
    "fsync": False,
    "direct_io": True,
    "strict": False,
    "allow_missing": ("ema", "sampler"),
}


def test_every_checkpoint_config_field_survives_the_saver_command_line():
    fields = {f.name for f in dataclasses.fields(CheckpointConfig)}
    assert set(NOT_DEFAULT) == fields, (
        f"CheckpointConfig fields without a non-default value in NOT_DEFAULT: {sorted(fields - set(NOT_DEFAULT))}"
    )
    config = CheckpointConfig(**NOT_DEFAULT)
    default = CheckpointConfig()
    for name in fields:
        assert getattr(config, name) != getattr(default, name), name
    args = SaverArgs(config=config, trainer_pid=4242, ranks=(2, 3), world_size=8, run_id="abc123",
                     socket=Path("/dev/shm/ftkit-saver-1.sock"), commit_timeout=7.5, connect_timeout=30.0,
                     events=Path("/jobs/j/events.jsonl"), shm_dir=Path("/mnt/huge-shm"))
    back = SaverArgs.from_argv(args.to_argv())
    for name in fields:
        assert getattr(back.config, name) == getattr(config, name), name
    assert back == args
    assert args.command()[1:3] == ["-m", SAVER_MODULE]


def test_defaults_round_trip_and_a_bad_config_field_names_itself():
    args = SaverArgs(config=CheckpointConfig(root="/tmp/ck"), trainer_pid=1)
    assert SaverArgs.from_argv(args.to_argv()) == args
    argv = args.to_argv()
    argv[argv.index("--config") + 1] = '{"root": "/tmp/ck", "keep_last": 0}'
    with pytest.raises(ValueError, match=r"checkpoint\.keep_last"):
        SaverArgs.from_argv(argv)


def test_from_cmdline_reads_a_saver_and_nothing_else():
    args = SaverArgs(config=CheckpointConfig(root="/tmp/ck"), trainer_pid=1, ranks=(0, 1))
    cmdline = b"\0".join(a.encode() for a in args.command()) + b"\0"
    assert SaverArgs.from_cmdline(cmdline) == args
    assert SaverArgs.from_cmdline(b"python3\0-m\0pytest\0tests\0") is None
    assert SaverArgs.from_cmdline(cmdline.replace(b"--config", b"--konfig")) is None  # another version's
    garbled = b"\0".join([sys.executable.encode(), b"-m", SAVER_MODULE.encode(), b"--config", b"{", b"--trainer-pid", b"1"])
    assert SaverArgs.from_cmdline(garbled) is None


def test_find_savers_reads_a_live_process_command_line(tmp_path):
    """A real process whose command line is a saver's (from ``SaverArgs``) is found through
    /proc for a job dir holding its root, not for another one."""
    job, other = tmp_path / "job", tmp_path / "other"
    job.mkdir()
    other.mkdir()
    args = SaverArgs(config=CheckpointConfig(root=job / "checkpoints"), trainer_pid=1)
    # `python -c CODE -m MODULE ARGS`: the interpreter runs CODE, /proc shows a saver's command line
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", "-m", SAVER_MODULE,
                             *args.to_argv()], stdin=subprocess.PIPE)
    try:
        # Popen can return while exec is still setting up the child: /proc shows an empty cmdline
        deadline = time.monotonic() + 30
        while SAVER_MODULE.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes():
            assert time.monotonic() < deadline, "the child never showed its command line"
            time.sleep(0.01)
        assert find_savers(job) == [proc.pid]
        assert find_savers(other) == []
    finally:
        proc.communicate(b"", timeout=30)
    assert find_savers(job) == []
