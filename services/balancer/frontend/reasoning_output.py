"""A chat reply's reasoning: which format the model writes it in, and the switches
that reach the chat template.

The format is chosen once (balancer.reasoning_parser, or the chat template's own:
reasoning_parsers.choose_reasoning_parser). A reply is split before it is read for
tool calls, so the tool parser sees the content only; a reply constrained to calls
(tool_choice required or named) is not split, since it holds no reasoning.
reasoning_effort and the thinking switches reach the template in chat_template.py.
/v1/responses serves chat calls, so its reasoning items follow the same rule.
Every job of a split call also counts its reasoning tokens for usage
(reasoning_parsers/count.py), streamed or not.
"""

from services.balancer.frontend.choices import Call
from services.balancer.frontend.reasoning_parsers import (
    PROMPT_TAIL_TOKENS,
    ReasoningTokenCount,
    choose_reasoning_parser,
    new_splitter,
)
from services.balancer.frontend.tool_output import ToolPlan
from shared.recipe import Recipe


class ReasoningSupport:
    """The model's reasoning format, chosen once (the setting, or its chat template's)."""

    def __init__(self, setting: str, recipe: Recipe) -> None:
        self.recipe = recipe
        self.parser = choose_reasoning_parser(setting, recipe.chat_template_source())

    @property
    def keeps_special_tokens(self) -> bool:
        return self.parser is not None and new_splitter(self.parser).keeps_special_tokens

    def attach(self, call: Call, tools: ToolPlan | None, stream: bool) -> None:
        """Split the call's replies into reasoning and content (unless constrained to calls)."""
        if self.parser is None or (tools is not None and tools.mode != "auto"):
            return
        call.reasoning = self.parser
        call.prompt_tail = self.prompt_tail(call.prompts[0])
        for job in call.jobs:
            if stream:
                job.reasoning = new_splitter(self.parser, call.prompt_tail, raw=tools is not None)
            # Its own splitter over each token's text from the job's detokenizer (count.py).
            job.reasoning_count = ReasoningTokenCount(new_splitter(self.parser, call.prompt_tail))

    def prompt_tail(self, prompt_ids: list[int]) -> str:
        """The prompt's last text, enough to see whether it opened a thinking block."""
        return self.recipe.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
