"""Tool-call parsers, chosen with `--tool-call-parser NAME` (vLLM's names)."""

from __future__ import annotations

from voltserve.services.gateway.tool_parsers.base import ToolCall, ToolParser, ToolStreamer
from voltserve.services.gateway.tool_parsers.hermes import HermesToolParser
from voltserve.services.gateway.tool_parsers.llama3_json import Llama3JsonToolParser
from voltserve.services.gateway.tool_parsers.mistral import MistralToolParser
from voltserve.services.gateway.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "qwen3_xml": Qwen3CoderToolParser,
}

__all__ = ["TOOL_PARSERS", "ToolCall", "ToolParser", "ToolStreamer"]
