"""EdgeWhitespace: streamed text with the whitespace at its edges dropped, for the tool-call and
reasoning parsers (whitespace touching a tag or a call is not part of the text beside it).

A subclass sets `_skip_ws` when the next text's leading whitespace must go (after a tag or a
call) and reads `_held_ws`, the trailing whitespace held back until what follows is known.
Plain Python: no parsing, no I/O.
"""

from __future__ import annotations


class EdgeWhitespace:
    _held_ws = ""    # trailing whitespace, held until what follows is known
    _skip_ws = False  # the next text's leading whitespace is dropped

    def _trimmed(self, text: str) -> str:
        """This piece of text to emit now: its leading whitespace dropped when `_skip_ws`, the
        held whitespace before it, its own trailing whitespace held back ("": nothing yet)."""
        if self._skip_ws:
            text = text.lstrip()
            if not text:
                return ""
            self._skip_ws = False
        text = self._held_ws + text
        kept = text.rstrip()
        self._held_ws = text[len(kept):]
        return kept
