"""A conversation as the model's tokens: rendered by the chat template, the last
message left open with continue_final_message, encoded with or without special tokens;
reasoning_effort and thinking switches passed where the template reads them."""

from typing import Any

from services.balancer.frontend import protocol as p
from services.balancer.frontend.errors import APIError
from services.balancer.frontend.tool_prompt import template_inputs
from shared.recipe import Recipe

THINKING_SWITCHES = ("enable_thinking", "thinking")
"""chat_template_kwargs that turn a template's thinking on or off (Qwen3's, DeepSeek's)."""


def encode_chat(recipe: Recipe, body: p.ChatCompletionRequest | p.TokenizeChatRequest) -> list[int]:
    messages = [m.for_template() for m in body.messages]
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if getattr(body, "tools", None) else None
    source = recipe.chat_template_source(with_tools=tools is not None)
    messages, tools = template_inputs(source, messages, tools)  # tools the template cannot take, written in
    kwargs = {
        **(body.chat_template_kwargs or {}), **template_switches(source, body),
        "add_generation_prompt": body.add_generation_prompt,
    }
    try:
        text = recipe.apply_chat_template(messages, tools=tools, **kwargs)
    except (ValueError, TypeError) as exc:  # the template refused, or bad template kwargs
        raise APIError(400, str(exc), param="messages") from exc
    if body.continue_final_message:
        text = _open_final_message(text, body.messages[-1], body.add_generation_prompt)
    return recipe.encode(text, add_special_tokens=body.add_special_tokens)


def _open_final_message(text: str, last: p.ChatMessage, add_generation_prompt: bool) -> str:
    """The rendered conversation cut right after the last message's content, so the
    reply continues it (transformers' continue_final_message)."""
    content = last.text.strip()
    at = text.rfind(content) if content else -1
    if at < 0:
        raise APIError(400, "continue_final_message: the chat template does not render the last message's "
                       "content as given, so it cannot be left open", param="continue_final_message")
    return text[: at + len(content)]


def template_switches(source: str | None, body: p.ChatCompletionRequest | p.TokenizeChatRequest) -> dict[str, Any]:
    """The template variables a request's reasoning_effort sets, checked with its
    thinking switches against what the template reads: one the template does not
    read would change nothing, so it is a 400 that names it."""
    for key in THINKING_SWITCHES:
        if key in (body.chat_template_kwargs or {}) and (source is None or key not in source):
            raise APIError(400, f"chat_template_kwargs.{key}: this model's chat template has no such thinking "
                           "switch (it would change nothing); leave it out", param=f"chat_template_kwargs.{key}")
    effort = getattr(body, "reasoning_effort", None)
    if effort is None:
        return {}
    if source is None or "reasoning_effort" not in source:
        raise APIError(400, "reasoning_effort: this model's chat template takes no reasoning effort (it would "
                       "change nothing); leave it out", param="reasoning_effort")
    return {"reasoning_effort": effort}
