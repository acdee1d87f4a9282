"""The Recipe: tokenizer, chat template and streaming detokenizer of a model (see tokenizer.py)."""

from shared.recipe.chat_template import ChatTemplate, ChatTemplateError
from shared.recipe.detokenizer import IncrementalDetokenizer
from shared.recipe.tokenizer import Recipe
from shared.recipe.train_tokenizer import train_tokenizer

__all__ = ["ChatTemplate", "ChatTemplateError", "IncrementalDetokenizer", "Recipe", "train_tokenizer"]
