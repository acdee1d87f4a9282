"""tools/bench/raw_file.py: every raw file says which commit, device, command, date
and versions made it; "+dirty" marks a tree that differed from its commit."""

import json
import subprocess
import sys

from tools.bench.raw_file import commit, read_json, run_header, tee_stdout, write_json, write_text

KEYS = {"commit", "device", "cpu", "command", "cwd", "environment", "date", "versions"}


def _git(root, *args):
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout.strip()


def test_commit_is_head_and_dirty_only_for_changes_outside_docs(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    _git(tmp_path, "add", "code.py")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = _git(tmp_path, "rev-parse", "HEAD")
    assert commit(tmp_path) == head
    (tmp_path / "docs" / "perf").mkdir(parents=True)
    (tmp_path / "docs" / "perf" / "run.json").write_text("{}")  # a raw file being written: not a change
    assert commit(tmp_path) == head
    (tmp_path / "new.py").write_text("")  # untracked code is
    assert commit(tmp_path) == head + "+dirty"
    (tmp_path / "new.py").unlink()
    (tmp_path / "code.py").write_text("x = 2\n")
    assert commit(tmp_path) == head + "+dirty"
    assert commit(tmp_path.parent / "no-such-folder").startswith("unknown")


def test_header_names_the_command_and_versions(monkeypatch):
    monkeypatch.setenv("INFERMESH_ENGINE__BLOCK_SIZE", "8")
    header = run_header()
    assert set(header) == KEYS
    assert header["command"].split()[0] == sys.orig_argv[0]
    assert header["environment"] == {"INFERMESH_ENGINE__BLOCK_SIZE": "8"}
    assert {"torch", "nixl", "python"} <= set(header["versions"]) and header["versions"]["torch"]
    assert "cores" in header["cpu"] and header["date"][:2] == "20"


def test_json_text_markdown_and_tee_raw_files_carry_the_header(tmp_path, capsys):
    header = {**run_header(), "commit": "abc+dirty"}
    write_json(tmp_path / "f.json", {"levels": [1]}, header)
    got_header, figures = read_json(tmp_path / "f.json")
    assert got_header == header and figures == {"levels": [1]}
    (tmp_path / "old.json").write_text(json.dumps([1, 2]))
    assert read_json(tmp_path / "old.json") == (None, [1, 2])  # a file from before the header
    write_text(tmp_path / "t.md", "| a |", header)
    md = (tmp_path / "t.md").read_text()
    assert md.startswith("- commit: `abc+dirty`") and md.endswith("| a |\n")
    with tee_stdout(tmp_path / "sub" / "log.txt", header):
        print("figure 1.00")
    log = (tmp_path / "sub" / "log.txt").read_text().splitlines()
    assert log[0] == "# commit: abc+dirty" and log[-1] == "figure 1.00"
    assert "figure 1.00" in capsys.readouterr().out  # still printed
