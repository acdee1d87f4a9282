"""The chat formats of seeded checkpoints, as each family's released files carry them:
make_model trains the project's tokenizer, then gives it the family's format tokens
and its chat template, so the seeded folder chats (and calls tools) as the real one.

- GPT-OSS: harmony's special tokens (`<|start|>`, `<|channel|>`, `<|message|>`,
  `<|constrain|>`, `<|end|>`, `<|call|>`, `<|return|>`, ...), eos `<|return|>`,
  generation stopping at `<|return|>`, `<|call|>` or `<|endoftext|>` (gpt-oss's
  generation_config), no bos added by encode, and ``chat_template.jinja`` as openai/gpt-oss
  ships it (templates/gpt_oss_chat_template.jinja: the released text, byte for byte).
- Qwen2.5-VL: Qwen2's special tokens with the vision ones (`<|vision_start|>`,
  `<|vision_end|>`, `<|image_pad|>`, `<|video_pad|>`...), eos `<|im_end|>`, generation
  stopping at `<|im_end|>` or `<|endoftext|>`, no bos added by encode, and
  ``chat_template.jinja`` as Qwen/Qwen2.5-VL ships it in chat_template.json
  (templates/qwen2_5_vl_chat_template.jinja), which the processor expands per image.
- Qwen3 (dense): Qwen2's special tokens, eos `<|im_end|>`, generation stopping at
  `<|im_end|>` or `<|endoftext|>`, no bos added by encode; `<tool_call>`, `<tool_response>`,
  `<think>`, `</think>` (and their closers, the fim tokens) single tokens that decode as
  text, as Qwen3's tokenizer has them; the chat template in tokenizer_config.json's
  chat_template, where Qwen/Qwen3-8B ships it (templates/qwen3_chat_template.jinja:
  the released hybrid-thinking template, `enable_thinking` and `<think>` handling, tools).
  Written into the repository from knowledge of the released text, checked against
  public copies, not downloaded; tests/unit/test_chat_formats.py renders it as
  transformers does.
- DeepSeek-V4: bos `<｜begin▁of▁sentence｜>` (added by encode) and eos
  `<｜end▁of▁sentence｜>` special; `<｜User｜>`, `<｜Assistant｜>`, `<think>`, `</think>`
  single tokens that decode as text, as DeepSeek's tokenizer has them; no template:
  DeepSeek ships the format as code (encoding/encoding_dsv4.py), which the Recipe
  renders by the folder's model_type (shared/recipe/deepseek_v4_chat.py).

The tokens are added after training, so make_model trains that many fewer: the
tokenizer keeps the size asked for.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, processors

from shared.recipe import deepseek_v4_chat as v4

TEMPLATES = Path(__file__).parent / "templates"


@dataclass(frozen=True, slots=True)
class ChatFormat:
    special_tokens: tuple[str, ...]
    """Added as special tokens (skipped by decode unless asked)."""
    text_tokens: tuple[str, ...]
    """Added as single tokens that decode as text."""
    bos_token: str
    eos_token: str
    pad_token: str
    stop_tokens: tuple[str, ...]
    """generation_config.json's eos_token_id, in the released order."""
    adds_bos: bool
    """Whether encode(add_special_tokens=True) starts with bos."""
    template_file: str | None
    """The released chat_template.jinja (under templates/), or None where the format is code."""
    template_in_config: bool = False
    """The family ships its template as tokenizer_config.json's chat_template (Qwen3), not as chat_template.jinja."""

    @property
    def num_tokens(self) -> int:
        return len(self.special_tokens) + len(self.text_tokens)


FORMATS: dict[str, ChatFormat] = {
    "gpt_oss": ChatFormat(
        special_tokens=("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>",
                        "<|start|>", "<|end|>", "<|message|>", "<|call|>"),
        text_tokens=(),
        bos_token="<|startoftext|>", eos_token="<|return|>", pad_token="<|endoftext|>",
        stop_tokens=("<|return|>", "<|endoftext|>", "<|call|>"),
        adds_bos=False,
        template_file="gpt_oss_chat_template.jinja",
    ),
    "qwen2_5_vl": ChatFormat(
        special_tokens=("<|endoftext|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
                        "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
                        "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"),
        text_tokens=(),
        bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
        adds_bos=False,
        template_file="qwen2_5_vl_chat_template.jinja",
    ),
    # Qwen3-VL: the same tokens for images and turns. Its released chat template (tools,
    # no default system prompt) is not reproduced yet: the folder gets Qwen2.5-VL's,
    # whose image parts render the same <|vision_start|><|image_pad|><|vision_end|>.
    "qwen3_vl": ChatFormat(
        special_tokens=("<|endoftext|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
                        "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
                        "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"),
        text_tokens=(),
        bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
        adds_bos=False,
        template_file="qwen2_5_vl_chat_template.jinja",
    ),
    "qwen3": ChatFormat(
        special_tokens=("<|endoftext|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
                        "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
                        "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"),
        text_tokens=("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                     "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
                     "<think>", "</think>"),
        bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
        adds_bos=False,
        template_file="qwen3_chat_template.jinja",
        template_in_config=True,
    ),
    "deepseek_v4": ChatFormat(
        special_tokens=v4.SPECIAL_TOKENS,
        text_tokens=v4.ADDED_TOKENS,
        bos_token=v4.BOS, eos_token=v4.EOS, pad_token=v4.EOS,
        stop_tokens=(v4.EOS,),
        adds_bos=True,
        template_file=None,
    ),
}  # fmt: skip
"""By make_model's --arch (the config's model_type); other families keep the project's ChatML."""


def apply_chat_format(folder: Path, chat_format: ChatFormat) -> tuple[int, int, list[int]]:
    """Give the trained tokenizer in folder the format's tokens, names and template;
    return the ids of bos, eos and the stop tokens."""
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in chat_format.special_tokens])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in chat_format.text_tokens])
    ids = {t: tokenizer.token_to_id(t) for t in (*chat_format.special_tokens, *chat_format.text_tokens)}
    ids.update({t: tokenizer.token_to_id(t) for t in (chat_format.eos_token, *chat_format.stop_tokens)})
    steps = [processors.ByteLevel(trim_offsets=False)]
    if chat_format.adds_bos:
        bos = chat_format.bos_token
        steps.append(processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, ids[bos])],
        ))  # fmt: skip
    tokenizer.post_processor = processors.Sequence(steps)
    (folder / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")

    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["added_tokens_decoder"] = {
        str(token_id): {
            "content": token.content, "lstrip": token.lstrip, "normalized": token.normalized,
            "rstrip": token.rstrip, "single_word": token.single_word, "special": token.special,
        }
        for token_id, token in sorted(tokenizer.get_added_tokens_decoder().items())
    }  # fmt: skip
    named = {chat_format.bos_token, chat_format.eos_token, chat_format.pad_token}
    extra = [t for t in config.get("additional_special_tokens", []) if t not in named]
    config["additional_special_tokens"] = extra + [t for t in chat_format.special_tokens if t not in named]
    config.update(bos_token=chat_format.bos_token, eos_token=chat_format.eos_token, pad_token=chat_format.pad_token)
    config.pop("chat_template", None)  # the family's own, below, or none (V4's is code)
    template = TEMPLATES / chat_format.template_file if chat_format.template_file is not None else None
    if template is not None and chat_format.template_in_config:
        config["chat_template"] = template.read_text(encoding="utf-8")
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
    if template is not None and not chat_format.template_in_config:
        (folder / "chat_template.jinja").write_bytes(template.read_bytes())
    return ids[chat_format.bos_token], ids[chat_format.eos_token], [ids[t] for t in chat_format.stop_tokens]
