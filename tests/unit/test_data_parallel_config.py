"""data_parallel_size as a setting: INFERMESH_ENGINE__DATA_PARALLEL_SIZE and `infermesh up
--data-parallel-size` reach EngineConfig, and what a mesh instance cannot run with it is
checked before anything starts (preflight), the mesh running data-parallel instances."""

from pathlib import Path

import pytest

from shared.runtime.settings import load_settings
from tests.helpers.hf_models import save_tiny_hf_model
from tools.cli import build_parser
from tools.launch.preflight import PreflightError, check_parallel
from tools.launch.up import parallel_env


def test_the_setting_and_the_flags_reach_the_engine_config() -> None:
    engine = load_settings(env=parallel_env(None, True, data_parallel_size=2)).engine
    assert (engine.data_parallel_size, engine.enable_expert_parallel, engine.num_ranks) == (2, True, 2)
    assert load_settings(env=parallel_env(None, None)).engine.data_parallel_size == 1  # not given: the default
    generate = build_parser().parse_args(["generate", "--model", "m", "--data-parallel-size", "2",
                                          "--enable-expert-parallel", "--prompt", "hi"])  # fmt: skip
    assert (generate.engine_data_parallel_size, generate.engine_enable_expert_parallel) == (2, True)
    up = build_parser().parse_args(["up", "--data-parallel-size", "2"])
    assert up.data_parallel_size == 2


def test_preflight_takes_data_parallel_instances_and_names_the_flag(tmp_path: Path) -> None:
    """`infermesh up --data-parallel-size 2 --enable-expert-parallel` passes preflight with
    an MoE model (the mesh runs data-parallel instances); without expert parallelism it is
    refused before anything starts, naming the flag."""
    model = str(save_tiny_hf_model("qwen3_moe", tmp_path / "moe", seed=1))
    check_parallel(model, 1, True, data_parallel_size=2)
    with pytest.raises(PreflightError, match=r"--data-parallel-size 2: data_parallel_size > 1 runs data-parallel"):
        check_parallel(model, 1, False, data_parallel_size=2)
