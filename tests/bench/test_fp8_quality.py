"""bench/fp8_quality.py's text and flags (the runs themselves: the benchmark)."""

import argparse
import json

import pytest

from bench.fp8_quality import parse_override, write_corpus


def test_the_corpus_takes_every_source_folder_and_leaves_installed_packages_to_their_own(tmp_path):
    std, pkgs = tmp_path / "lib", tmp_path / "venv"
    for path in (std / "a.py", std / "json" / "b.py", std / "site-packages" / "x" / "c.py", pkgs / "torch" / "d.py"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {path.name}\n")
    corpus = tmp_path / "corpus.jsonl"

    def texts(sources, recursive):
        write_corpus(str(corpus), [str(s) for s in sources], recursive)
        return [json.loads(line)["text"] for line in corpus.read_text().splitlines()]

    assert texts([std], recursive=False) == ["# a.py\n"]
    assert texts([std], recursive=True) == ["# a.py\n", "# b.py\n"]
    assert texts([std, pkgs], recursive=True) == ["# a.py\n", "# b.py\n", "# d.py\n"]
    with pytest.raises(SystemExit, match="no \\*.py under"):
        write_corpus(str(corpus), [str(tmp_path / "empty")])


def test_an_override_reads_its_value_as_json_where_it_parses():
    assert parse_override("num_hidden_layers=4") == ("num_hidden_layers", 4)
    assert parse_override("compile=true") == ("compile", True)
    assert parse_override("preset=llama-7b") == ("preset", "llama-7b")
    with pytest.raises(argparse.ArgumentTypeError, match="key=value"):
        parse_override("compile")
