"""What tensor parallelism does not run yet is refused by name where it is configured
(EngineConfig, `infermesh up`'s preflight), never ignored."""

import json
from pathlib import Path

import pytest

from shared.engine.config import EngineConfig
from shared.runtime.settings import load_settings
from tools.launch.preflight import PreflightError, check_parallel
from tools.launch.up import parallel_env


@pytest.mark.parametrize(
    ("settings", "refused"),
    [
        (dict(speculative="ngram"), "speculative decoding"),
        (dict(quantized_weights="keep"), "quantized weights kept as stored"),
        (dict(device="cuda", cuda_graphs=True), "CUDA graphs"),
    ],
)
def test_what_tensor_parallelism_cannot_run_is_refused_by_name(settings: dict, refused: str) -> None:
    EngineConfig(**settings)  # fine on one rank
    with pytest.raises(ValueError, match=f"not implemented yet: {refused} with tensor_parallel_size > 1"):
        EngineConfig(tensor_parallel_size=2, **settings)


def test_cuda_graphs_are_no_obstacle_on_the_cpu_and_off_on_cuda() -> None:
    assert EngineConfig(tensor_parallel_size=2).cuda_graphs  # the CPU never captures graphs
    EngineConfig(tensor_parallel_size=2, device="cuda", cuda_graphs=False)


def test_a_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1, got 0"):
        EngineConfig(tensor_parallel_size=0)


def test_the_mesh_checks_how_instances_split_before_starting(tmp_path: Path) -> None:
    """`infermesh up --tensor-parallel-size N [--enable-expert-parallel]` runs instances of
    N ranks; what no instance could start with is one line before anything starts."""
    dense = _config(tmp_path / "dense", num_attention_heads=4, num_key_value_heads=2)
    check_parallel(dense, 1, False)
    check_parallel(dense, 2, False)  # each rank one KV head
    check_parallel(dense, 4, False)  # KV heads replicated on two ranks each
    with pytest.raises(PreflightError, match=r"--tensor-parallel-size 3: num_attention_heads \(4\) is not divisible"):
        check_parallel(dense, 3, False)
    with pytest.raises(PreflightError, match=r"--tensor-parallel-size 2: enable_expert_parallel needs an MoE model"):
        check_parallel(dense, 2, True)
    with pytest.raises(PreflightError, match=r"--tensor-parallel-size 1: enable_expert_parallel splits the experts"):
        check_parallel(dense, 1, True)


def _config(folder: Path, **dims: int) -> str:
    """A Llama config.json (no weights: the split is decided from the config alone)."""
    folder.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 256, "rms_norm_eps": 1e-6,
              "max_position_embeddings": 128, **dims}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_up_hands_its_eplb_flags_to_every_instance_as_engine_settings() -> None:
    """`infermesh up ... --enable-expert-parallel --enable-eplb --eplb-config JSON`: the
    environment every instance starts with reads back as those engine settings, and
    EPLB without expert parallelism is refused where up checks the settings."""
    eplb = '{"window_size": 8, "step_interval": 6, "num_redundant_experts": 2}'
    engine = load_settings(env=parallel_env(2, True, True, eplb)).engine
    assert (engine.tensor_parallel_size, engine.enable_expert_parallel, engine.enable_eplb) == (2, True, True)
    assert (engine.eplb_settings().window_size, engine.eplb_settings().num_redundant_experts) == (8, 2)
    assert load_settings(env=parallel_env(2, True)).engine.enable_eplb is False  # not given: the default
    with pytest.raises(ValueError, match="enable_eplb places experts across expert-parallel ranks"):
        load_settings(env=parallel_env(2, False, True))
