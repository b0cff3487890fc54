"""The ``galaxy`` command (``python -m galaxy``, the console script setup.py installs): it lists the
commands, hands each its script's flags, and refuses an unknown command with one line and exit 2."""

import contextlib
import io
import os
import runpy
import subprocess
import sys

import pytest

from galaxy.cli.main import COMMANDS, main
from tests import REPO


def help_of(run) -> str:
    """What ``run()`` prints for ``--help`` (argparse exits 0 after printing)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        run()
    assert done.value.code == 0
    return out.getvalue()


def test_help_lists_every_command_and_its_script():
    # galaxy/__main__.py is run here, as ``python -m galaxy`` (a module run as __main__ is tested by running it)
    out = subprocess.run([sys.executable, "-m", "galaxy", "--help"], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    for name in ("pretrain", "finetune", "plan", "profile", "infer", "compare"):
        assert f"  {name} " in out.stdout
    for _, _, script in COMMANDS.values():
        assert script in out.stdout
        assert os.path.isfile(os.path.join(REPO, script)), script


@pytest.mark.parametrize("name", ["pretrain", "finetune", "plan"])  # two given a plan and a description; a plain one
def test_a_command_takes_its_scripts_flags(name, monkeypatch):
    script = os.path.join(REPO, COMMANDS[name][2])
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    theirs = help_of(lambda: runpy.run_path(script, run_name="__main__"))
    ours = help_of(lambda: main([name, "--help"]))
    flags = lambda text: sorted({w.strip("[],") for w in text.split() if w.startswith(("--", "[--"))})  # noqa: E731
    assert flags(ours) == flags(theirs) and flags(ours)


def test_an_unknown_command_is_one_line_and_exit_2(capsys):
    assert main(["pretrian"]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "unknown command 'pretrian'" in err
