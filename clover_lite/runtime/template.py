"""Fill-in templates: fixed text and named slots, laid out as a canvas of given and masked positions.

Syntax (docs/ARCHITECTURE.md section 9):
    {name}          a slot whose spec comes from the call (`slots={"name": 8}` or `slots={"name": ["a", "b"]}`)
    {name:8}        a free slot of 8 masked positions; the model writes it, unused positions take the end token
    {name:a|b|c}    a slot whose value is one of the listed strings
    {{ and }}       literal braces

Fixed text is tokenized piece by piece, so each piece's tokens sit on the block grid exactly where they fall.
Spaces that end the text before a slot move into the slot (BPE vocabularies attach a leading space to the
next word, so " open" is one token where " " + "open" would be two the model never saw together); a slot's
value is reported without it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from clover_lite.errors import GenerationError

SlotSpec = int | Sequence[str]
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
MAX_SLOT_POSITIONS = 4096


@dataclass
class Slot:
    """One slot laid out: its positions in the canvas and, for a choice, each option as token ids padded with
    the end token to the slot's length."""

    name: str
    start: int  # first canvas position
    length: int
    lead: str = ""  # whitespace moved in from the fixed text before it
    options: list[str] | None = None  # the allowed strings, as given
    option_ids: list[list[int]] | None = None  # each option's own tokens (unpadded)

    def padded(self, end_token_id: int | None) -> list[list[int]]:
        """Each option as the slot writes it: its tokens, then the end token to the slot's length. A choice is
        scored on these (the padding included: the canvas holds it afterwards) and writes them. Options of
        unequal lengths need an end token (build_canvas refuses them without one)."""
        assert self.option_ids is not None
        return [ids + [end_token_id] * (self.length - len(ids)) for ids in self.option_ids]  # type: ignore[list-item]


@dataclass
class Canvas:
    """Token ids of the filled-in text: `tokens[i]` a given id, or None where a slot's position is masked."""

    tokens: list[int | None]
    slots: list[Slot]
    pieces: list[str | Slot]  # the template in order, for writing the filled text back
    end_token_id: int | None = None  # what pads a choice's shorter options and ends a free slot

    def slot_at(self) -> list[tuple[int, int] | None]:
        """For each canvas position, (slot index, index inside the slot), None for fixed text."""
        where: list[tuple[int, int] | None] = [None] * len(self.tokens)
        for k, s in enumerate(self.slots):
            for j in range(s.length):
                where[s.start + j] = (k, j)
        return where


def parse(template: str) -> list[str | tuple[str, str | None]]:
    """The template as fixed strings and (name, inline spec or None) pairs."""
    if not isinstance(template, str):
        raise GenerationError(f"a template is a string, got {type(template).__name__}")
    out: list[str | tuple[str, str | None]] = []
    text, i = [], 0
    while i < len(template):
        c = template[i]
        if template.startswith(("{{", "}}"), i):
            text.append(c)
            i += 2
        elif c == "}":
            raise GenerationError(f"template: a '}}' at offset {i} closes no slot; write '}}}}' for a literal brace")
        elif c == "{":
            close = template.find("}", i)
            if close < 0:
                raise GenerationError(f"template: the '{{' at offset {i} is never closed; write '{{{{' for a "
                                      "literal brace")
            body = template[i + 1 : close]
            name, sep, spec = body.partition(":")
            if not _NAME.match(name):
                raise GenerationError(f"template: slot name {name!r} at offset {i} is not an identifier (letters, "
                                      "digits, _)")
            if text:
                out.append("".join(text))
                text = []
            out.append((name, spec if sep else None))
            i = close + 1
        else:
            text.append(c)
            i += 1
    if text:
        out.append("".join(text))
    return out


def _spec(name: str, inline: str | None, given: Mapping[str, SlotSpec]) -> SlotSpec:
    if inline is not None and name in given:
        raise GenerationError(f"slot {name!r} is specified both in the template and in `slots`; keep one")
    if inline is None:
        if name not in given:
            raise GenerationError(f"slot {name!r} has no spec: write {{{name}:N}} or {{{name}:a|b}}, or pass "
                                  f"slots={{{name!r}: ...}}")
        return given[name]
    if inline.strip().isdigit():
        return int(inline)
    return inline.split("|")


def build_canvas(tokenizer, template: str, slots: Mapping[str, SlotSpec] | None, end_token_id: int | None,
                 mask_token_id: int, labels: Mapping[str, str] | None = None) -> Canvas:
    """Lay `template` out as token ids and masked positions. Every bad slot is one GenerationError naming it:
    a duplicate name, a spec that is neither a length nor a list of strings, no options, an empty or repeated
    option, an option the tokenizer cannot encode exactly, a choice of unequal lengths with no end token.
    `labels` names slots in those errors as the caller's user knows them (decide's questions)."""
    labels = labels or {}
    given = dict(slots or {})
    items = parse(template)
    names = [it[0] for it in items if isinstance(it, tuple)]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise GenerationError(f"template: slot name(s) {dup} appear more than once; give each slot its own name")
    unused = sorted(set(given) - set(names))
    if unused:
        raise GenerationError(f"slots {unused} are not in the template (its slots: {names})")
    if not names:
        raise GenerationError("the template has no slot to fill; mark one as {name:N} or {name:a|b}")
    tokens: list[int | None] = []
    out_slots: list[Slot] = []
    pieces: list[str | Slot] = []
    for k, it in enumerate(items):
        if isinstance(it, str):
            text = it
            if k + 1 < len(items) and isinstance(items[k + 1], tuple):
                text = it.rstrip(" \t")  # the trailing spaces go into the slot
            if text:
                tokens += tokenizer.encode(text)
            pieces.append(it[: len(text)] if text != it else it)
            continue
        name, inline = it
        lead = ""
        if k > 0 and isinstance(items[k - 1], str):
            prev = items[k - 1]
            lead = prev[len(prev.rstrip(" \t")):]
        spec = _spec(name, inline, given)
        slot = Slot(name=name, start=len(tokens), length=0, lead=lead)
        if isinstance(spec, bool) or not isinstance(spec, int | list | tuple):
            raise GenerationError(f"slot {name!r}: give a number of positions or a list of strings, not "
                                  f"{type(spec).__name__}")
        if isinstance(spec, int):
            if not 1 <= spec <= MAX_SLOT_POSITIONS:
                raise GenerationError(f"slot {name!r}: {spec} positions; give 1 to {MAX_SLOT_POSITIONS}")
            slot.length = spec
        else:
            label = labels.get(name, name)
            slot.options, slot.option_ids = _options(tokenizer, label, list(spec), lead, mask_token_id)
            slot.length = max(len(ids) for ids in slot.option_ids)
            if end_token_id is None and len({len(ids) for ids in slot.option_ids}) > 1:
                raise GenerationError(f"slot {label!r}: its options have different token lengths and the model has "
                                      "no pad or end token to fill the shorter ones; make them the same length")
        tokens += [None] * slot.length
        out_slots.append(slot)
        pieces.append(slot)
    return Canvas(tokens=tokens, slots=out_slots, pieces=pieces, end_token_id=end_token_id)


def check_options(name: str, options: list) -> None:
    """One GenerationError naming question `name` unless `options` is a non-empty list of distinct, non-empty
    strings (what the tokenizer can encode is checked where there is one, in build_canvas)."""
    if not options:
        raise GenerationError(f"question {name!r} has no options; give at least one allowed answer")
    bad = [o for o in options if not isinstance(o, str)]
    if bad:
        raise GenerationError(f"question {name!r}: option {bad[0]!r} is not a string")
    if any(not o for o in options):
        raise GenerationError(f"question {name!r} has an empty option; every option needs some text")
    dup = sorted({o for o in options if options.count(o) > 1})
    if dup:
        raise GenerationError(f"question {name!r} lists {dup} more than once")


def _options(tokenizer, name: str, options: list, lead: str, mask_token_id: int) -> tuple[list[str], list[list[int]]]:
    check_options(name, options)
    ids = []
    for o in options:
        t = tokenizer.encode(lead + o)
        if not t or tokenizer.decode(t) != lead + o or mask_token_id in t:
            raise GenerationError(f"question {name!r}: the tokenizer cannot encode option {o!r} exactly (it reads "
                                  f"back as {tokenizer.decode(t)!r}); use characters the model's vocabulary has")
        ids.append(t)
    return options, ids


def filled_text(canvas: Canvas, values: Mapping[str, str]) -> str:
    """The template with each slot replaced by its value (and the whitespace it took from the text before)."""
    return "".join(p if isinstance(p, str) else p.lead + values[p.name] for p in canvas.pieces)


__all__ = ["Slot", "Canvas", "SlotSpec", "parse", "build_canvas", "check_options", "filled_text", "MAX_SLOT_POSITIONS"]
