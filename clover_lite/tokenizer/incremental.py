"""The text of a growing list of token ids, decoding only a few ids at its end at each push.

A decoding loop shows the whole generated text after every step; decoding all ids again each time costs
time that grows with the reply. The committed ids only ever grow, so the text up to a clean boundary (a
point where the text does not end in U+FFFD, i.e. no multi-byte character is cut there) is final, and
only the ids after it need decoding again: `decode(ids[prefix:])` minus `decode(ids[prefix:read])`, the
prefix/read offsets of Hugging Face's TextStreamer and vLLM's incremental detokenizer. The subtraction
(not a decode of the new ids alone) keeps context-dependent decodes right, such as sentencepiece dropping
the leading space of a text's first piece.

That needs a decode that is local: the text after a clean boundary depends only on a few ids before it.
Byte-level BPE, Metaspace and sentencepiece decodes are (Tokenizer.incremental_decoder picks the window
for those); for any other decode the decoder re-decodes every id at each push, exact and O(length).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

REPLACEMENT = "\ufffd"  # what a byte-level or byte-fallback decode shows for a character cut short


class IncrementalDecoder:
    """`text` is `decode(ids)` of all ids pushed so far, at every push.

    `windowed` decodes only the ids since a clean boundary plus a few before it (`window` ids, at
    least one that shows some text); a decode found not to be local (the window's text no longer starts
    with its context) switches to re-decoding all ids for the rest. `decode` is called with lists the
    decoder owns: it may read them, not keep or change them.
    """

    def __init__(self, decode: Callable[[list[int]], str], windowed: bool = True, window: int = 8) -> None:
        self._decode = decode
        self.windowed = windowed
        self.window = window
        self._ids: list[int] = []
        self.text: str = decode([])
        # text[:changed_from] is unchanged by the last push: a new stop string match must end after it.
        self.changed_from = 0
        self._read = 0  # a clean boundary: ids[:read] decode to `_final`, which no later id changes
        self._final = self.text
        self._prefix = 0  # the window's start (a clean boundary); 0 or ids[prefix:read] decode to some text
        self._context = self.text  # decode(ids[prefix:read])

    def push(self, new_ids: Iterable[int]) -> str:
        """Append `new_ids`; return the text of all ids so far."""
        n0 = len(self._ids)
        self._ids.extend(new_ids)
        n = len(self._ids)
        if n == n0:
            self.changed_from = len(self.text)
            return self.text
        if not self.windowed:
            return self._redecode()
        window = self._decode(self._ids[self._prefix :])
        if not window.startswith(self._context):  # not a local decode after all: exact, the slow way
            self.windowed = False
            return self._redecode()
        self.changed_from = len(self._final)
        self.text = self._final + window[len(self._context) :]
        if not self.text.endswith(REPLACEMENT):  # a clean boundary at n: hold back text ending in a cut character
            read = self._read
            self._read, self._final, self._context = n, self.text, window
            if n - self._prefix > self.window:
                # Start the window at the previous boundary instead, if the ids since then show text: an empty
                # context would lose what depends on the text before it (sentencepiece's first-piece space).
                context = self._decode(self._ids[read:n])
                if context:
                    self._prefix, self._context = read, context
        return self.text

    def ids_covering(self, text: str) -> int:
        """The fewest of the ids pushed so far whose decode starts with `text` (a prefix of `self.text`): a
        reply cut at a stop string keeps those and drops the ids after them. Walks back from the end, since a
        stop string spans a few ids."""
        k = len(self._ids)
        while k > 0 and self._decode(self._ids[: k - 1]).startswith(text):
            k -= 1
        return k

    def _redecode(self) -> str:
        self.text, self.changed_from = self._decode(self._ids), 0
        return self.text


__all__ = ["IncrementalDecoder", "REPLACEMENT"]
