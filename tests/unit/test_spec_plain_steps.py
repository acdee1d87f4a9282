"""tools/bench/spec_plain_steps.py on the CPU: the four engines' steps are timed and a
speculating engine held at depth 0 takes no drafting step (it is what the tool claims)."""

import re

from tools.bench import spec_plain_steps


def test_times_the_four_cases_and_holds_depth_zero(capsys) -> None:  # noqa: ANN001
    spec_plain_steps.main(["--batch", "2", "--rounds", "1"])
    out = capsys.readouterr().out
    times = dict(re.findall(r"^  (plain engine|dspark as it schedules|dspark at depth 0|its speculator detached)"
                            r"\s+([0-9.]+)", out, re.M))
    assert set(times) == {"plain engine", "dspark as it schedules", "dspark at depth 0", "its speculator detached"}
    assert all(float(v) > 0 for v in times.values())
    drafting = dict(re.findall(r"(dspark as it schedules|dspark at depth 0) (\d+)", out.split("drafting steps:")[1]))
    assert drafting["dspark at depth 0"] == "0"  # held: plain steps only, what the tool claims to time
