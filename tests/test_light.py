"""`import ftkit` and `ftkit --help` stay light: no torch import."""

from __future__ import annotations

import subprocess
import sys


def run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout


def test_import_ftkit_does_not_import_torch() -> None:
    out = run("import sys, ftkit; print('torch' in sys.modules, 'watchdog' in sys.modules)")
    assert out.split() == ["False", "False"]


def test_cli_help_does_not_import_torch() -> None:
    code = (
        "import sys\nfrom ftkit.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('IMPORTED_TORCH' if 'torch' in sys.modules else 'LIGHT')"
    )
    out = run(code)
    assert "usage: ftkit" in out and out.strip().endswith("LIGHT")


def test_console_script_and_module_entry_point() -> None:
    out = subprocess.run([sys.executable, "-m", "ftkit", "--help"], capture_output=True, text=True, check=True)
    for command in ("save", "kill", "request", "status"):
        assert command in out.stdout
