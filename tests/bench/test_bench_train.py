"""``bench/bench_train.py`` on CPU + Gloo at world 2, tiny shapes: one launch yields a row for every contender
asked for (a time or a one-line reason), and the comm bytes it reads from the dispatcher for Galaxy's plans
equal what Galaxy's own metrics report for the same step."""

import json
import os
import subprocess
import sys

import pytest

from tests import REPO

ROOT = REPO
sys.path.insert(0, ROOT)

from bench.bench_train import contender_names, select  # noqa: E402

# Compiling on two shared CPU cores takes minutes: the compiled contenders run in the GPU smoke
# (bench/device/train_harness.sh 1 smoke) instead.
SKIP = "serial-compiled,galaxy-*+compile,native-tp-sp-compiled,native-tp-sp-asynctp"


def test_every_contender_has_a_row_and_galaxy_bytes_match_metrics(tmp_path):
    out = tmp_path / "train.json"
    run = subprocess.run([sys.executable, "bench/bench_train.py", "--cpu", "--world", "2", "--scenario", "smoke",
                          "--skip", SKIP, "--warmup", "0", "--iters", "1", "--json", str(out)], cwd=ROOT,
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {r["name"]: r for r in report["rows"]}
    assert list(rows) == select("*", SKIP) and report["world"] == 2
    for name, r in rows.items():
        if "error" in r:  # a contender that cannot run here says why, in one line
            assert r["error"].strip() and "\n" not in r["error"], name
            assert not name.startswith(("galaxy", "serial-eager", "native-tp-sp-eager")), (name, r["error"])
            continue
        assert r["median_ms"] > 0 and r["min_ms"] <= r["median_ms"] <= r["max_ms"], name
        if name.startswith("galaxy-") and r["ranks"] == 2:
            assert r["comm_bytes"] > 0 and r["comm_bytes"] == r["comm_bytes_metrics"], name
            assert r["comm_bytes_per_rank"] == [r["comm_bytes"]] * 2, name
    assert rows["serial-eager"]["comm_bytes"] == 0 and rows["galaxy-none"]["comm_bytes"] == 0
    assert rows["native-tp-sp-eager"]["comm_bytes"] > 0
    # PARTIAL gradients are reduced inside the step: galaxy2 moves more than tp (its replicated MLP weights)
    assert rows["galaxy-galaxy2"]["comm_bytes"] > rows["galaxy-tp"]["comm_bytes"]
    assert "native-tp-sp-eager" in run.stdout  # the table for people


def test_contender_selection():
    names = contender_names()
    assert len(names) == len(set(names))
    assert select("galaxy-galaxy2*", "*+compile") == ["galaxy-galaxy2", "galaxy-galaxy2-overlap",
                                                      "galaxy-galaxy2-sharded"]
    assert "galaxy-tp-overlap" not in names  # tp has no PARTIAL gradients to reduce differently
    with pytest.raises(SystemExit):
        from bench.bench_train import main
        main(["--contenders", "no-such-contender"])
