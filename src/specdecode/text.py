"""Incremental detokenization with stop strings: text appears as soon as it cannot change any more."""

from __future__ import annotations


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of chat messages under the model's chat template, ready for the assistant's answer."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """chat_prompt_ids where the tokenizer has a chat template; for a base model (Gemma 3 270M ships without one)
    the turns' text, blank-line separated, for it to continue. For prompts the tools make (training, tuning,
    benchmark questions); a user's --chat on a base model is refused instead (api)."""
    if getattr(tokenizer, "chat_template", None):
        return chat_prompt_ids(tokenizer, messages)
    text = "\n\n".join(message["content"] for message in messages) + "\n\n"
    return list(tokenizer(text)["input_ids"])


class TextAssembler:
    """Feed token ids step by step; get back the text that is final.

    Text is held back while the last character is an incomplete multi-byte sequence, and while the text's end
    could be the beginning of a stop string. When a stop string appears, the text before it is released and
    `stopped` is set; the stop string itself is not part of the output (as in OpenAI's API).
    """

    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.tokens: list[int] = []
        self.released = ""
        self.stopped = False

    def add(self, tokens: list[int]) -> str:
        if self.stopped:
            return ""
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        hits = [i for i in (text.find(s, max(0, len(self.released) - len(s))) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._release(text[: min(hits)])
        if text.endswith("\ufffd"):
            return ""
        return self._release(text[: len(text) - self._partial_stop(text)])

    def flush(self) -> str:
        """The rest of the text once generation has ended."""
        if self.stopped:
            return ""
        return self._release(self.tokenizer.decode(self.tokens, skip_special_tokens=True))

    def _release(self, text: str) -> str:
        if len(text) <= len(self.released):
            return ""
        delta = text[len(self.released) :]
        self.released = text
        return delta

    def _partial_stop(self, text: str) -> int:
        """Length of the longest end of `text` that begins some stop string."""
        return max((n for s in self.stop for n in range(min(len(s) - 1, len(text)), 0, -1) if s.startswith(text[-n:])), default=0)
