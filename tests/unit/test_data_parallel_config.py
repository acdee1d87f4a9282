"""data_parallel_size as a setting: INFERMESH_ENGINE__DATA_PARALLEL_SIZE and `infermesh up
--data-parallel-size` reach EngineConfig, and what a mesh instance cannot run with it is
refused by name (EngineConfig.check_mesh, which `up` and the services call first)."""

import pytest

from shared.engine.config import EngineConfig
from shared.runtime.settings import load_settings
from tools.cli import build_parser
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


def test_a_mesh_instance_refuses_data_parallel_attention_and_takes_one_rank() -> None:
    EngineConfig().check_mesh()
    EngineConfig(tensor_parallel_size=2, enable_expert_parallel=True).check_mesh()  # EP alone runs in the mesh
    with pytest.raises(ValueError, match=r"--data-parallel-size 4 \(data_parallel_size\) is not supported in the "
                                         r"mesh yet: data-parallel attention runs in the engine"):  # fmt: skip
        EngineConfig(data_parallel_size=4, enable_expert_parallel=True).check_mesh()
