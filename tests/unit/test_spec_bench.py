"""tools/bench/spec_bench run tiny on the CPU: every mode's tokens equal the run
without speculation, the figures are consistent, the JSON and the table are written."""

import json

from tests.helpers.hf_models import save_tiny_hf_model
from tools.bench.spec_bench import main


def test_spec_bench_runs_tiny(tmp_path, capsys):
    model = save_tiny_hf_model("llama", tmp_path / "m")
    out = tmp_path / "spec.json"
    rc = main(["--model", str(model), "--draft", str(model), "--batch", "1", "3", "--spec-tokens", "2", "4",
               "--max-tokens", "12", "--json", str(out)])  # fmt: skip
    assert rc == 0
    raw = json.loads(out.read_text())
    assert raw["header"]["commit"] and raw["header"]["versions"]["torch"]  # tools/bench/raw_file.py's header
    rows = raw["rows"]
    assert [(r["batch"], r["mode"]) for r in rows] == [
        (b, m)
        for b in (1, 3)
        for m in ("none", "fixed γ=2", "fixed γ=4", "dspark γ=4", "capacity γ=4", "none (control)")
    ]
    for r in rows:
        assert r["equal_to_none"] and r["output_tokens"] == 12 * r["batch"]
        assert abs(r["tokens_per_s"] - r["output_tokens"] / r["seconds"]) < 1e-6
        assert len(r["runs_s"]) == 3 and sorted(r["runs_s"])[1] == r["seconds"]  # the median of the timed runs
        # The draft is the target itself: everything drafted is accepted.
        speculates = not r["mode"].startswith("none")
        assert (r["mean_accepted_length"] > 1.5) == speculates
        # The timed runs' steps by drafting depth: plain steps only without speculation.
        assert bool(r["steps_by_depth"]) == speculates
        # Read against "none" of the same batch size, timed in turns with it.
        none = next(n for n in rows if n["batch"] == r["batch"] and n["mode"] == "none")
        assert abs(r["vs_none"] - r["tokens_per_s"] / none["tokens_per_s"]) < 1e-9
        # Drafting time where the timed runs drafted: every step of a fixed γ; the
        # scheduled modes only where drafting paid (or a probe or trial fell in them).
        drafted = any(int(depth) > 0 for depth in r["steps_by_depth"])
        assert (r["drafting_ms_per_run"] > 0) == drafted
        assert drafted or r["mode"].split()[0] in ("none", "dspark", "capacity")
    table = capsys.readouterr().out
    assert "dspark γ=4" in table and "lossless" in table and "vs none" in table
