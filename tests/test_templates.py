"""sbatch templates: rendering against recorded files, the renderer's errors, bash syntax,
and the batch-script logic run for real (bash, signals) with a fake scontrol on PATH.

Regenerate the recorded files after an intended template change with
``FTKIT_UPDATE_EXPECTED=1 pytest tests/test_templates.py`` and review the diff.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftkit.cli import main
from ftkit.errors import ConfigError
from ftkit.slurm import templates

EXPECTED = Path(__file__).parent / "expected"
UPDATE = os.environ.get("FTKIT_UPDATE_EXPECTED") == "1"
BASH = shutil.which("bash")

CUSTOM = {
    "job_name": "resnet",
    "time": "04:00:00",
    "lead_time": "300",
    "partition": "gpu",
    "gpus_per_node": "4",
    "jobdir": "/scratch/$USER/resnet",
    "python": "/opt/venv/bin/python",
    "extra_sbatch": "--mem=64G\n#SBATCH --exclusive",
    "max_requeues": "5",
}

CASES = [(name, {}) for name in ("single", "srun", "torchrun")] + [
    ("single", CUSTOM),
    ("srun", {**CUSTOM, "nodes": "2", "ntasks_per_node": "4", "command": '"$PYTHON" train.py --lr 0.1'}),
    ("torchrun", {**CUSTOM, "nodes": "4", "nproc_per_node": "8", "command": "train.py --config big.yaml"}),
]


def _case_id(name: str, values: dict) -> str:
    return name if not values else f"{name}-custom"


def test_shipped_templates_are_listed() -> None:
    assert templates.list_templates() == ["single", "srun", "torchrun"]
    assert templates.templates_dir().name == "sbatch_templates"
    for name in templates.list_templates():
        assert templates.template_description(name)


@pytest.mark.parametrize(("name", "values"), CASES, ids=[_case_id(*c) for c in CASES])
def test_rendered_matches_recorded(name: str, values: dict) -> None:
    text = templates.render(name, values)
    path = EXPECTED / f"{_case_id(name, values)}.sbatch"
    if UPDATE:
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} missing: run FTKIT_UPDATE_EXPECTED=1 pytest {__file__}"
    assert text == path.read_text(), f"{name} renders differently from {path}; if intended, regenerate"


@pytest.mark.skipif(BASH is None, reason="needs bash")
@pytest.mark.parametrize(("name", "values"), CASES, ids=[_case_id(*c) for c in CASES])
def test_rendered_is_valid_bash(name: str, values: dict, tmp_path: Path) -> None:
    path = tmp_path / f"{name}.sbatch"
    path.write_text(templates.render(name, values))
    proc = subprocess.run([BASH, "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name", ["single", "srun", "torchrun"])
def test_every_template_has_the_fault_tolerance_parts(name: str) -> None:
    text = templates.render(name)
    for part in ("#SBATCH --signal=B:USR1@180", "#SBATCH --requeue", "#SBATCH --open-mode=append",
                 "#SBATCH --output=", "#SBATCH --error=", "trap on_usr1 USR1", "trap on_term TERM",
                 "ftkit request requeue", "ftkit request save-exit", 'wait "$PID"',
                 'ftkit requeue "$JOBDIR" --exit-code "$rc" --max-requeues 20', "exit $?"):
        assert part in text, f"{name}: missing {part!r}"
    assert "{{" not in text and "}}" not in text
    # torchrun would die of a forwarded SIGUSR1: there the request file is the only path
    assert ('kill -USR1 "$PID"' in text) == (name != "torchrun")


def test_empty_sbatch_values_drop_the_line_and_lines_repeat() -> None:
    text = templates.render("single", {"extra_sbatch": "--mem=1G\n\n#SBATCH --exclusive"})
    assert "--partition" not in text and "--gpus-per-node" not in text
    assert "#SBATCH --mem=1G\n#SBATCH --exclusive\n" in text
    assert "#SBATCH --partition=low\n" in templates.render("single", {"partition": "low"})


def test_unknown_setting_names_it_and_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown setting 'nodes'.*valid settings: command, cpus_per_task"):
        templates.render("single", {"nodes": "2"})  # single is one node


def test_missing_template_lists_available() -> None:
    with pytest.raises(ConfigError, match=r"no nope\.sbatch in .*available: single, srun, torchrun"):
        templates.render("nope")


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("lead_time", "soon", "a whole number >= 1"),
    ("time", "4 hours", "a SLURM time limit"),
    ("job_name", "a\nb", "a single line"),
])
def test_invalid_values_name_the_setting(key: str, value: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=rf"{key}=.*expected {expected}"):
        templates.render("single", {key: value})


@pytest.mark.parametrize(("time", "lead_time"), [("00:02:00", "180"), ("2", "120"), ("1:30", "90")])
def test_a_lead_time_not_shorter_than_the_time_limit_is_refused(time: str, lead_time: str) -> None:
    """SIGUSR1 would come at once: every run would save, exit and requeue right after it began."""
    with pytest.raises(ConfigError, match=rf"lead_time={lead_time} is not shorter than time={time}"):
        templates.render("single", {"time": time, "lead_time": lead_time})
    assert "--signal=B:USR1@60" in templates.render("single", {"time": time, "lead_time": "60"})
    assert templates.render("single", {"time": "UNLIMITED", "lead_time": "100000"})


def test_own_templates_dir_and_required_placeholders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mine.sbatch").write_text("#!/bin/bash\n# ftkit template: mine -- mine\n"
                                          "#SBATCH --time={{time}}\n#SBATCH --account={{account}}\n")
    monkeypatch.setenv("FTKIT_TEMPLATES_DIR", str(tmp_path))
    assert templates.list_templates() == ["mine"]
    assert templates.template_params("mine") == {"time": "01:00:00", "account": None}
    with pytest.raises(ConfigError, match=r"'account' has no value and no default; give it with --set account="):
        templates.render("mine")
    assert "#SBATCH --account=proj1\n" in templates.render("mine", {"account": "proj1"})


def test_malformed_placeholder_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "bad.sbatch").write_text("#!/bin/bash\necho {{not-a-name}}\n")
    with pytest.raises(ConfigError, match=r"line 2: malformed placeholder"):
        templates.render("bad", directory=tmp_path)


def test_templates_dir_errors_name_the_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTKIT_TEMPLATES_DIR", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match=r"FTKIT_TEMPLATES_DIR=.*missing is not a directory"):
        templates.templates_dir()
    monkeypatch.delenv("FTKIT_TEMPLATES_DIR")
    monkeypatch.setattr(templates, "_candidates", lambda: [tmp_path / "a", tmp_path / "b"])
    with pytest.raises(ConfigError, match=r"no sbatch templates found; looked in .*a, .*b\. Set FTKIT_TEMPLATES_DIR"):
        templates.list_templates()


def test_cli_renders_to_file_and_lists(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "job.sbatch"
    rc = main(["template", "single", "--set", "time=02:00:00", "--sbatch=--mem=8G", "-o", str(out)])
    assert rc == 0
    assert out.read_text() == templates.render("single", {"time": "02:00:00", "extra_sbatch": "--mem=8G"})
    assert main(["template", "--list"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in ("single", "srun", "torchrun", "lead_time"))
    assert main(["template", "single", "--set", "bogus=1"]) == 2
    assert main(["template", "single", "--set", "novalue"]) == 2
    assert "unknown setting 'bogus'" in capsys.readouterr().err


@pytest.mark.skipif(BASH is None, reason="needs bash")
@pytest.mark.parametrize("name", ["single", "srun", "torchrun"])
def test_a_python_without_ftkit_stops_the_job_at_once_naming_the_setting(name: str, tmp_path: Path) -> None:
    """The traps and ``ftkit requeue`` run ``$PYTHON -m ftkit``: with a Python that lacks ftkit
    (a venv not active in the batch script) the job trained to its end, then could not requeue
    itself. It stops before the training, saying which setting to fix."""
    nopy = tmp_path / "python-without-ftkit"
    nopy.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")  # no site-packages: no ftkit
    nopy.chmod(0o755)
    marker = tmp_path / "trained"
    script = tmp_path / "job.sbatch"
    script.write_text(templates.render(name, {"python": str(nopy), "jobdir": str(tmp_path / "job"),
                                              "command": f"touch {marker}"}))
    proc = subprocess.run([BASH, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"ftkit: {nopy} cannot import ftkit: render this script with --set python=" in proc.stderr
    assert not marker.exists()  # nothing ran


# --------------------------------------------------------------------------------------
# the rendered single.sbatch, run by bash with real signals (SLURM replaced by a fake scontrol)

FAKE_SCONTROL = """#!/bin/bash
echo "$*" >> "$FAKE_SCONTROL_LOG"
case "$1" in
  show) echo "JobId=4242 JobName=t JobState=RUNNING Reason=None Restarts=0 PreemptTime=None Command=/nonexistent WorkDir=/tmp" ;;
  requeue) exit 0 ;;
  *) exit 1 ;;
esac
"""


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


@pytest.mark.skipif(BASH is None or not sys.platform.startswith("linux"), reason="needs bash and /proc")
@pytest.mark.parametrize(("sig", "expected_rc", "requeued"), [(signal.SIGUSR1, 0, True), (signal.SIGTERM, 0, False)])
def test_batch_script_relays_signal_and_requeues(tmp_path: Path, sig: signal.Signals, expected_rc: int,
                                                 requeued: bool) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "scontrol").write_text(FAKE_SCONTROL)
    (bindir / "scontrol").chmod(0o755)
    jobdir = tmp_path / "job"
    # The "training": exits 0 on the forwarded signal, like a trainer that saved in time.
    # (Python, not bash: the template starts the program with USR1 ignored until it installs
    # a handler, and a bash script cannot trap a signal ignored on entry.)
    trainer = tmp_path / "trainer.py"
    trainer.write_text(
        "import pathlib, signal, sys, time\n"
        "for s in (signal.SIGUSR1, signal.SIGTERM):\n"
        "    signal.signal(s, lambda *a: sys.exit(0))\n"
        "pathlib.Path(sys.argv[1], 'ready').touch()\n"
        "while True:\n"
        "    time.sleep(0.1)\n"
    )
    command = f'"$PYTHON" {trainer} "$JOBDIR"'
    script = tmp_path / "job.sbatch"
    script.write_text(templates.render("single", {"jobdir": str(jobdir), "python": sys.executable,
                                                  "command": command}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{bindir}:{env['PATH']}", FAKE_SCONTROL_LOG=str(tmp_path / "scontrol.log"),
               SLURM_JOB_ID="4242", SLURM_JOB_NAME="t", SLURM_RESTART_COUNT="0")
    proc = subprocess.Popen([BASH, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 20
        while not (jobdir / "ready").exists():
            assert time.monotonic() < deadline and proc.poll() is None, "training never started"
            time.sleep(0.02)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            for child in _children(proc.pid):
                os.kill(child, signal.SIGKILL)
            proc.kill()
            proc.communicate()
    assert proc.returncode == expected_rc, out
    assert "training exited with code 0" in out
    # each line's time, made without a subshell (one forked as SLURM's SIGTERM arrives dies)
    stamped = re.findall(r"^ftkit: (?:job .* at|SIG\w+(?: from SLURM)? at|training exited with code 0 at) "
                         r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", out, re.M)
    assert len(stamped) == 3, out
    log = (tmp_path / "scontrol.log").read_text()
    assert ("requeue 4242" in log) == requeued, log
    runs = json.loads((jobdir / "runs.json").read_text())["runs"]
    assert len(runs) == 1 and runs[0]["requeue"] is requeued and runs[0]["job_id"] == "4242"
    if requeued:
        assert runs[0]["cause"] == "requested (SIGUSR1)"
        assert "ftkit requeue: requeued job 4242 (requested (SIGUSR1)" in out
    else:
        assert "ftkit requeue: not requeued" in out
    assert list((jobdir / "requests").glob("*.json")) == []  # the trap's request is spent
