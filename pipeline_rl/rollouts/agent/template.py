"""Chat-template rendering of a conversation's first prompt and of the messages between turns.

The tokens between two model turns are the template's text for the new messages only, rendered
after a fixed stand-in conversation (a user message and an assistant message holding MARK) and
cut off after it: the earlier turns are never rendered or tokenized again, and a template that
renders earlier turns differently once later ones exist (e.g. drops their reasoning) changes
nothing already in the transcript.

What closes an assistant turn in the template (END: the text after MARK, e.g. "<|im_end|>\\n")
goes first. When the model's turn ended with END's first token (its EOS, e.g. "<|im_end|>"),
only the rest of END is added ("\\n"); otherwise (cut off at the token limit) all of it, so the
next messages never run on inside the model's turn.
"""

from __future__ import annotations

from typing import Any

MARK = "<<pipeline_rl: assistant turn>>"
STAND_IN = [{"role": "user", "content": "."}, {"role": "assistant", "content": MARK}]


class ChatTemplate:
    """One conversation's rendering: `tools` (OpenAI schemas or None) are rendered with every
    message, as the template places them (usually in the system prompt)."""

    def __init__(self, tokenizer: Any, template: str | None, tools: list[dict] | None):
        self.tokenizer, self.template, self.tools = tokenizer, template, tools or None
        if template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template: set actor.domain_settings.chat_template")
        self.stand_in = self.render(STAND_IN, generation_prompt=False)
        at = self.stand_in.rfind(MARK)
        if at < 0:
            raise ValueError("the chat template does not render an assistant message's content")
        self.end_of_turn = self.stand_in[at + len(MARK) :]

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=self.tools,
            chat_template=self.template,
            tokenize=False,
            add_generation_prompt=generation_prompt,
        )

    def encode(self, text: str) -> list[int]:
        # The template writes any BOS itself: no special tokens added.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The first turn's prompt: the messages and the assistant's generation prompt."""
        return self.encode(self.render(messages, generation_prompt=True))

    def between_turns(self, last_token: int | None, messages: list[dict]) -> list[int]:
        """Tokens after a model turn that ended with `last_token`: the rest of the assistant turn's
        closing, the new `messages`, and the next generation prompt."""
        full = self.render(STAND_IN + messages, generation_prompt=True)
        if not full.startswith(self.stand_in):
            raise ValueError("the chat template renders earlier messages differently once new ones follow them")
        close = self.end_of_turn
        if last_token is not None:
            ending = self.tokenizer.decode([last_token], skip_special_tokens=False)
            if ending and close.startswith(ending):
                close = close[len(ending) :]
        return self.encode(close + full[len(self.stand_in) :])
