import subprocess
import sys

from lockstep.cli import SUBCOMMANDS, main


def test_help_lists_every_subcommand(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out


def test_console_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "lockstep.cli", "--help"], capture_output=True, text=True, check=True)
    assert "plan" in out.stdout
