"""A conversation as the model's tokens: rendered by the chat template, the last
message left open with continue_final_message, encoded with or without special tokens."""

from services.balancer.frontend import protocol as p
from services.balancer.frontend.errors import APIError
from services.balancer.frontend.tool_prompt import template_inputs
from shared.recipe import Recipe


def encode_chat(recipe: Recipe, body: p.ChatCompletionRequest | p.TokenizeChatRequest) -> list[int]:
    messages = [m.for_template() for m in body.messages]
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if getattr(body, "tools", None) else None
    source = recipe.chat_template_source(with_tools=tools is not None)
    messages, tools = template_inputs(source, messages, tools)  # tools the template cannot take, written in
    kwargs = {**(body.chat_template_kwargs or {}), "add_generation_prompt": body.add_generation_prompt}
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
