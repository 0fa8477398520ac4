"""gpt-oss replies: the harmony format's channels and function calls.

A gpt-oss reply is a run of messages written with special tokens. Each message has a header (its channel, and for
a function call the recipient) and a body::

    <|channel|>analysis<|message|>The user asks for ...<|end|>
    <|start|>assistant<|channel|>final<|message|>It is 4.           (then <|return|>, a stop token)

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}   (then <|call|>)

The ``analysis`` channel is the thinking; ``final`` (and ``commentary`` without a recipient, a preamble) is what
the user reads; a message to ``functions.NAME`` is a call with its JSON arguments as the body. The recipient may
stand before the channel too (``<|start|>assistant to=functions.f<|channel|>commentary json<|message|>``).

``--reasoning-parser gpt_oss`` takes the thinking out and leaves the answer as plain text, with each call message
kept in its markup for ``--tool-call-parser gpt_oss``, which turns it into a call. Both keep special tokens in the
text they read. A reply that parser does not read takes the call messages out with :class:`GptOssCallReader`. Text outside any message (a reply that does not follow the format) is answer text.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from typing import Any, ClassVar

from plinth.entrypoints.openai.reasoning_parsers import ReasoningParser, Split
from plinth.entrypoints.openai.tool_parsers import (
    ParsedCall,
    Scan,
    ToolParser,
    arguments_json,
    held_prefix,
    join_segments,
)

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
#: tokens that end a message's body (``<|call|>`` and ``<|return|>`` are stop tokens, so usually absent)
BODY_ENDS = ("<|end|>", "<|call|>", "<|return|>", START)
#: tokens that open a message's header
HEADER_OPENS = (START, CHANNEL)
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=\s|<\||$)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")


@dataclasses.dataclass(frozen=True)
class Message:
    """One harmony message of a reply (or a stretch of text outside the format: ``header`` empty)."""

    header: str          # from the message's first token up to <|message|> (excluded)
    body: str
    ended: bool          # its body's end token came (or the reply ended)
    end: str = ""        # the end token written after the body (<|end|>, <|call|>, <|return|>), if any

    @property
    def channel(self) -> str | None:
        m = _CHANNEL.search(self.header)
        return m.group(1) if m else None

    @property
    def recipient(self) -> str | None:
        m = _RECIPIENT.search(self.header)
        return m.group(1) if m else None

    @property
    def markup(self) -> str:
        """The message as the model wrote it, with its end token."""
        return f"{self.header}{MESSAGE}{self.body}{self.end}" if self.header else self.body


#: a reply that opens with the rest of a header naming the recipient (``<|start|>assistant`` ends the prompt)
_REPLY_RECIPIENT = re.compile(r"\s*(?:assistant\s*)?to=")


def _may_become_recipient(text: str) -> bool:
    """Whether ``text``, the start of a reply, could still grow into :data:`_REPLY_RECIPIENT`."""
    rest = text.lstrip()
    if "assistant".startswith(rest):
        return True
    if rest.startswith("assistant"):
        rest = rest[len("assistant"):].lstrip()
    return "to=".startswith(rest)


def _opens_with_recipient(text: str, final: bool) -> bool:
    """Whether ``text``, a reply, opens with the rest of a header naming its recipient: :data:`_REPLY_RECIPIENT`,
    then no ``<|start|>`` before the header's ``<|message|>``; at the reply's end, text without that ``<|message|>``
    and without special tokens is no header cut short but plain text (an answer that begins ``to=``, as the
    reasoning parser passes a final message's body on)."""
    if _REPLY_RECIPIENT.match(text) is None:
        return False
    body_at = text.find(MESSAGE)
    header = text if body_at < 0 else text[:body_at]
    if START in header:
        return False
    return body_at >= 0 or not final or "<|" in header


def _first(text: str, markers: Sequence[str], start: int) -> tuple[int, str]:
    """The earliest of ``markers`` in ``text`` from ``start``: ``(position, marker)``, ``(-1, "")`` if none."""
    best, found = -1, ""
    for marker in markers:
        i = text.find(marker, start)
        if i >= 0 and (best < 0 or i < best):
            best, found = i, marker
    return best, found


def _held(text: str, markers: Sequence[str]) -> int:
    """How much of the end of ``text`` may still become one of ``markers``."""
    return max(held_prefix(text, m) for m in markers)


def messages(text: str, final: bool) -> list[Message]:
    """The messages of ``text`` (a reply so far; ``final``: the whole reply). A header still being written is
    left out, and so is the end of a body that may still become an end token."""
    out: list[Message] = []
    pos = 0
    if _REPLY_RECIPIENT.match(text) is None and not final and _may_become_recipient(text):
        return out   # the reply's first words may yet be a recipient (the header of a call): held back
    while pos < len(text):
        # the prompt ends with <|start|>assistant, so a reply may open with the rest of a header that names its
        # recipient before the channel (" to=functions.f<|channel|>commentary json<|message|>...")
        opened = text.startswith(HEADER_OPENS, pos) or (pos == 0 and _opens_with_recipient(text, final))
        if not opened:   # text outside the format, up to the next header
            nxt, _ = _first(text, HEADER_OPENS, pos)
            stretch = text[pos:nxt if nxt >= 0 else len(text)]
            if nxt < 0 and not final:
                stretch = stretch[:len(stretch) - _held(stretch, HEADER_OPENS)]
            if stretch:
                out.append(Message("", stretch, nxt >= 0 or final))
            if nxt < 0:
                break
            pos = nxt
            continue
        body_at = text.find(MESSAGE, pos)
        if body_at < 0:   # the header is not complete yet (at the end of a reply cut short: markup only, dropped)
            break
        header = text[pos:body_at]
        body_start = body_at + len(MESSAGE)
        end, marker = _first(text, BODY_ENDS, body_start)
        if end < 0:
            body = text[body_start:]
            if not final:
                body = body[:len(body) - _held(body, BODY_ENDS)]
            out.append(Message(header, body, final))
            break
        out.append(Message(header, text[body_start:end], True, "" if marker == START else marker))
        pos = end if marker == START else end + len(marker)
    return out


def separated(previous: Message | None, m: Message) -> str:
    """``m``'s body, after a line break where it follows another message's body of the same kind (a preamble and
    the final answer, two stretches of thinking): the messages are separate paragraphs, not one run of words."""
    joined = previous is not None and previous.header and m.header and previous.recipient is None
    return "\n" + m.body if joined else m.body


class GptOssToolParser(ToolParser):
    """Messages to ``functions.NAME`` as calls; every other message's body as content."""

    name = "gpt_oss"
    keeps_special_tokens = True
    PREFIX: ClassVar[str] = "functions."
    #: a finished message to a recipient that makes no call is content in its markup (else it is dropped)
    keeps_markup: ClassVar[bool] = True

    def scan(self, text: str, final: bool) -> Scan:
        segments, calls = [""], []
        last = None
        for m in messages(text, final):
            if not (m.header and m.recipient is not None):
                segments[-1] += separated(last, m)
                last = m
                continue
            last = m
            call = self._call(m)
            if call is not None:
                calls.append(call)
                segments.append("")
            elif not m.ended:
                break   # a call still being written: nothing after it yet
            elif self.keeps_markup:
                segments[-1] += m.markup   # not a call after all: the markup is content, verbatim
            else:
                segments.append("")
        return Scan(join_segments(segments, len(segments) > 1, final), tuple(calls))

    def _call(self, m: Message) -> ParsedCall | None:
        """The call a finished message to ``functions.NAME`` makes (``None``: not a call, or not finished)."""
        recipient = m.recipient or ""
        if not m.ended or not recipient.startswith(self.PREFIX) or len(recipient) == len(self.PREFIX):
            return None
        try:
            args: Any = json.loads(m.body) if m.body.strip() else {}
        except (ValueError, RecursionError):   # (nesting deeper than Python's stack)
            return None
        text = arguments_json(args) if isinstance(args, dict) else None
        return ParsedCall(recipient[len(self.PREFIX):], text) if text is not None else None


class GptOssCallReader(GptOssToolParser):
    """The calls that :class:`GptOssReasoningParser` leaves in the answer, read for a request whose tool choice
    reads them with no ``gpt_oss`` tool parser: no markup stays in the content, a message to a recipient that
    makes no call is dropped."""

    keeps_markup = False


class GptOssReasoningParser(ReasoningParser):
    """The ``analysis`` channel as the thinking; the other messages as the answer (call messages in markup)."""

    name = "gpt_oss"
    keeps_special_tokens = True
    # several tokens each: structured outputs cannot wait for them (the engine says so at start-up)
    START = f"{CHANNEL}analysis{MESSAGE}"
    END = f"{CHANNEL}final{MESSAGE}"
    call_parser = GptOssCallReader

    def scan(self, text: str, final: bool) -> Split:
        thinking, answer = [], []
        found = messages(text, final)
        last_thought = last_said = None
        for i, m in enumerate(found):
            if m.header and m.channel == "analysis" and m.recipient is None:
                thinking.append(separated(last_thought, m))
                last_thought = m
            elif m.header and m.recipient is not None:
                # for the tool parser, with an end token where more follows (so that its body ends there)
                closed = m.end or i == len(found) - 1
                answer.append(m.markup if closed else m.markup + "<|end|>")
                last_said = m
            else:
                answer.append(separated(last_said, m))
                last_said = m
        return Split("".join(thinking), "".join(answer))
