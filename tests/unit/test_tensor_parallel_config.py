"""What tensor parallelism does not run yet is refused by name where it is configured
(EngineConfig, `infermesh up`'s preflight), never ignored: torch-free checks."""

import pytest

from shared.engine.config import EngineConfig
from tools.launch.preflight import PreflightError, check_tensor_parallel


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


def test_the_mesh_refuses_tensor_parallel_instances_before_starting() -> None:
    check_tensor_parallel(1)
    with pytest.raises(PreflightError, match=r"not implemented yet: --tensor-parallel-size 2 in the mesh"):
        check_tensor_parallel(2)
