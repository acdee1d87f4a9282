"""The Llama-family model, moved to ``shared/model/models/llama.py`` (one file per
architecture); this name stays for the modules that import it from here."""

from shared.model.models.llama import Attention, CausalLM, DecoderLayer, DecoderModel

__all__ = ["Attention", "CausalLM", "DecoderLayer", "DecoderModel"]
