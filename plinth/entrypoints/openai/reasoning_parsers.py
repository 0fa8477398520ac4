"""Reasoning parsers: the model's thinking apart from its answer.

Reasoning models write their thinking before the answer, between markers (``<think>`` ... ``</think>``).
``plinth serve --reasoning-parser NAME`` names the convention; chat replies then carry the thinking as
``reasoning_content`` (streamed as ``delta.reasoning_content``) and only the answer as ``content`` (where a
tool-call parser, if any, looks for calls). Parsers are plugins (``plinth_reasoning_parsers`` hook); built in:

- ``qwen3``: thinking only inside ``<think>`` ... ``</think>`` at the start of the reply (Qwen3's hybrid models); a
  reply without it is all answer (Qwen3 with ``enable_thinking`` off);
- ``deepseek_r1``: the reply starts in thinking (its template opens ``<think>`` in the prompt; a ``<think>`` the
  model writes itself is dropped) until ``</think>`` (DeepSeek-R1 and its distillations, QwQ, Qwen3 Thinking-2507);
- ``gpt_oss``: the harmony format's ``analysis`` channel (gpt-oss; :mod:`plinth.entrypoints.openai.harmony`).

As with tool-call parsers, :meth:`ReasoningParser.scan` sees the whole text so far and both parts only grow
(a marker cut in half at the end is held back); thinking that never ends stays thinking, so no text is lost.
Whitespace between the thinking and the answer is dropped.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from plinth.entrypoints.openai.tool_parsers import ToolParser, held_prefix, resolve_parser
from plinth.hookspecs import hookimpl

PLINTH_PLUGIN_API = "1.0"


@hookimpl
def plinth_reasoning_parsers() -> dict[str, str]:
    return {
        "qwen3": "plinth.entrypoints.openai.reasoning_parsers:Qwen3ReasoningParser",
        "deepseek_r1": "plinth.entrypoints.openai.reasoning_parsers:DeepSeekR1ReasoningParser",
        "gpt_oss": "plinth.entrypoints.openai.harmony:GptOssReasoningParser",
    }


@dataclasses.dataclass(frozen=True)
class Split:
    """A reply's thinking and its answer so far."""

    reasoning: str
    content: str


class ReasoningParser:
    """Base class of reasoning parsers: set :attr:`name`, implement :meth:`scan`, register the class with the
    ``plinth_reasoning_parsers`` hook."""

    name: ClassVar[str] = ""
    START: ClassVar[str] = "<think>"
    END: ClassVar[str] = "</think>"
    #: the chat template opens the thinking in the prompt, so a reply starts inside it (structured outputs
    #: then wait for END; otherwise they let the reply open the thinking with START first)
    starts_in_thinking: ClassVar[bool] = False
    #: the markers are special tokens (gpt-oss's channels): replies keep them in the text the parser reads
    keeps_special_tokens: ClassVar[bool] = False
    #: the tool parser that takes out of the answer the calls this parser leaves there in their markup (gpt-oss's
    #: call messages) where the request's ``auto`` tool parser is not one it derives from: they are the reply's
    #: calls where its tool choice makes calls, and are dropped where it makes none (no tools, ``"none"``)
    call_parser: ClassVar[type[ToolParser] | None] = None

    def scan(self, text: str, final: bool) -> Split:
        """The thinking and the answer in ``text`` (all generated so far; ``final``: all there will be).
        For a growing text both parts of each scan start with the previous scan's."""
        raise NotImplementedError

    def _from_thinking(self, text: str, final: bool) -> Split:
        """``text`` that starts inside the thinking."""
        end = text.find(self.END)
        if end < 0:
            return Split(text if final else text[:len(text) - held_prefix(text, self.END)], "")
        return Split(text[:end], text[end + len(self.END):].lstrip())


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def scan(self, text: str, final: bool) -> Split:
        body = text.lstrip()
        if body.startswith(self.START):
            return self._from_thinking(body[len(self.START):], final)
        if not final and self.START.startswith(body):   # may still open the thinking
            return Split("", "")
        return Split("", text)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_in_thinking = True

    def scan(self, text: str, final: bool) -> Split:
        body = text.lstrip()
        if body.startswith(self.START):
            body = body[len(self.START):]
        elif not final and self.START.startswith(body):
            return Split("", "")
        else:
            body = text
        return self._from_thinking(body, final)


def resolve_reasoning_parser(name: str | None) -> type[ReasoningParser] | None:
    """The parser class registered as ``name`` (``None``: no parser).

    Raises:
        ParserChoiceError: no parser has that name, or the registration is not a ReasoningParser subclass.
    """
    return resolve_parser("reasoning_parsers", "--reasoning-parser", "reasoning parser", name,  # type: ignore[no-any-return]
                          ReasoningParser)
