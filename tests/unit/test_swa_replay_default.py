"""swa_replay's default is the model's: bounded only for a model that declares it was
trained for bounded replay (DeepSeek-V4), exact for every other; an explicit setting wins."""

from shared.engine.config import EngineConfig
from shared.model.models import SUPPORTED_ARCHITECTURES, arch_traits


def test_only_deepseek_v4_declares_it_was_trained_for_bounded_replay():
    trained = [a for a in SUPPORTED_ARCHITECTURES if arch_traits(a).trained_for_bounded_replay]
    assert trained == ["DeepseekV4ForCausalLM"]


def test_unset_swa_replay_takes_the_models_default_and_a_setting_wins():
    assert EngineConfig().swa_replay is None
    assert EngineConfig().swa_replay_for(trained_for_bounded_replay=False) == "exact"
    assert EngineConfig().swa_replay_for(trained_for_bounded_replay=True) == "bounded"
    assert EngineConfig(swa_replay="bounded").swa_replay_for(trained_for_bounded_replay=False) == "bounded"
    assert EngineConfig(swa_replay="exact").swa_replay_for(trained_for_bounded_replay=True) == "exact"
