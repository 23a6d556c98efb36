"""A reply's growing text as chunks that are safe to show: used by the terminal commands and the server."""

from __future__ import annotations


class TextStreamer:
    """Turns the growing 'text so far' of step events into chunks safe to print: it holds back a
    trailing partial UTF-8 character and anything that could still turn out to start a stop string."""

    def __init__(self, stop: tuple[str, ...] = ()):
        self.printed = ""
        self.hold = max((len(s) for s in stop), default=1) - 1

    def feed(self, text: str) -> str:
        text = text.rstrip("\ufffd")
        safe = text[: max(0, len(text) - self.hold)]
        if not safe.startswith(self.printed) or len(safe) <= len(self.printed):
            return ""
        chunk, self.printed = safe[len(self.printed) :], safe
        return chunk

    def finish(self, text: str) -> str:
        if text.startswith(self.printed):
            return text[len(self.printed) :]
        # Should not happen (text only grows); show the whole answer rather than a garbled one.
        return "\n" + text
