"""Incremental detokenization and stop-string matching for one request."""
from __future__ import annotations

from pdserve.engine.tokenizer import Tokenizer

# Tokens of prompt context decoded with the first output tokens, so that spacing and
# multi-byte characters at the boundary come out as a full decode would give them.
_CONTEXT_TOKENS = 5


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...],
                 min_tokens: int = 0):
        """min_tokens: stop strings are looked for once more outputs than this are out
        (vLLM's rule)."""
        self.tokenizer = tokenizer
        self.token_ids = list(prompt_token_ids)
        self.num_prompt = len(prompt_token_ids)
        self.min_tokens = min_tokens
        self.prefix_offset = max(len(prompt_token_ids) - _CONTEXT_TOKENS, 0)
        self.read_offset = len(prompt_token_ids)
        self.stop = stop
        # A streamed delta never shows the start of a stop string that may complete
        # later: the last (longest stop - 1) characters wait, as in vLLM.
        self.holdback = max(map(len, stop)) - 1 if stop else 0
        self.text = ""  # decoded so far (trimmed before a matched stop string)
        self.emitted = 0  # of which this many characters have been handed out

    def resume(self, output_token_ids: list[int], text_sent: int) -> None:
        """A request moved here with these outputs, of whose text `text_sent`
        characters were handed out elsewhere: the text is rebuilt token by token as it
        was made, and the next delta starts after what was handed out (a tail held
        back there, the start of a stop string, say, is handed out here)."""
        for token_id in output_token_ids:
            self.append([token_id])
        self.emitted = min(text_sent, len(self.text))

    @property
    def emitted_text(self) -> str:
        return self.text[:self.emitted]

    def flush(self) -> str:
        """The request finished: hand out what was held back."""
        rest, self.emitted = self.text[self.emitted:], len(self.text)
        return rest

    def append(self, new_token_ids: list[int]) -> tuple[str, str | None]:
        """Adds tokens; returns (text to hand out now, the stop string matched or None).
        On a stop match the text is trimmed before the stop string and nothing after it
        shows."""
        self.token_ids.extend(new_token_ids)
        decode = self.tokenizer.decode
        prefix = decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = decode(self.token_ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return "", None  # an incomplete UTF-8 sequence: wait for more tokens
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        before = len(self.text)
        self.text += delta
        # Only the new text and the stop-length tail before it can hold a new match;
        # of several matches the earliest wins.
        stop_strings = self.stop if len(self.token_ids) - self.num_prompt > self.min_tokens else ()
        matches = [(at, stop) for stop in stop_strings
                   if (at := self.text.find(stop, max(before - len(stop) + 1, 0))) != -1]
        if matches:
            at, stop = min(matches)
            self.text = self.text[:at]
            return self.flush(), stop
        end = max(len(self.text) - self.holdback, self.emitted)
        out, self.emitted = self.text[self.emitted:end], end
        return out, None
