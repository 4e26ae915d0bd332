"""K3 chat I/O: the tokenizer, XTML prompt encoding and the reasoning / tool-call output parsers.

Pure string work, separate from the HTTP layer; see each module's docstring for the format.
"""

from serve.chat.encoding import encode_messages, render_messages, tokenize_messages
from serve.chat.parsing import Delta, OutputParser, ParsedOutput, make_tool_call_id, parse_output
from serve.chat.tokenizer import IncrementalDecoder, Tokenizer, TokenizerNotFound

__all__ = ["Delta", "IncrementalDecoder", "OutputParser", "ParsedOutput", "Tokenizer", "TokenizerNotFound",
           "encode_messages", "make_tool_call_id", "parse_output", "render_messages", "tokenize_messages"]
