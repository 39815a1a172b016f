"""How a token is shown to a reader, in a terminal table and on a picture's axis alike: the one
mapping every view of qkv uses (the page's ``app.js`` draws the same marks).

    space ' ' → '␣'    newline '\\n' → '↵'    tab '\\t' → '⇥'    carriage return '\\r' → '␍'

Other control characters are escaped as Python writes them ('\\x00'), and the empty token is
'∅'. A token with words keeps them: ' the' shows as '␣the', so a leading space (which makes a
different token) stays visible in a table, where a blank cell or a trailing space would not.
"""

from __future__ import annotations

from collections.abc import Sequence

WHITESPACE_MARKS: dict[str, str] = {" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"}
EMPTY_MARK = "∅"


def show_token(token: str) -> str:
    """``token`` as a reader sees it: whitespace as ␣ ↵ ⇥ ␍, other control characters escaped,
    the empty token as ∅ (see the module docstring)."""
    if not token:
        return EMPTY_MARK
    out = []
    for c in token:
        if c in WHITESPACE_MARKS:
            out.append(WHITESPACE_MARKS[c])
        elif c.isprintable():
            out.append(c)
        else:
            out.append(repr(c)[1:-1])
    return "".join(out)


def show_tokens(tokens: Sequence[str]) -> list[str]:
    """:func:`show_token` of each token."""
    return [show_token(t) for t in tokens]
