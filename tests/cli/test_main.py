"""The ``galaxy`` command (``python -m galaxy``, the console script setup.py installs): it lists the
commands, hands each its script's flags, and refuses an unknown command with one line and exit 2."""

import os
import subprocess
import sys

from galaxy.cli.main import COMMANDS
from tests import REPO


def galaxy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "galaxy", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120)


def test_help_lists_every_command_and_its_script():
    out = galaxy("--help")
    assert out.returncode == 0, out.stderr
    for name in ("pretrain", "finetune", "plan", "profile", "infer", "compare"):
        assert f"  {name} " in out.stdout
    for _, _, script in COMMANDS.values():
        assert script in out.stdout
        assert os.path.isfile(os.path.join(REPO, script)), script


def test_a_command_takes_its_scripts_flags():
    for name in ("pretrain", "finetune", "plan"):  # the two given a plan and a description, and a plain one
        script = COMMANDS[name][2]
        ours = galaxy(name, "--help")
        theirs = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, cwd=REPO,
                                timeout=120)
        assert ours.returncode == theirs.returncode == 0, ours.stderr + theirs.stderr
        flags = lambda text: sorted({w.strip("[],") for w in text.split() if w.startswith(("--", "[--"))})  # noqa: E731
        assert flags(ours.stdout) == flags(theirs.stdout), name


def test_an_unknown_command_is_one_line_and_exit_2():
    out = galaxy("pretrian")
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "unknown command 'pretrian'" in out.stderr
