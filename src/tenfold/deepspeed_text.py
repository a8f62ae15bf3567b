"""Reading a DeepSpeed config file as DeepSpeed reads it, and one step further.

DeepSpeed reads its config with hjson (`deepspeed/runtime/config.py`, `DeepSpeedConfig`:
`hjson.load(f, object_pairs_hook=dict_raise_error_on_duplicate_keys)`). Hjson is JSON plus
`#`, `//` and `/* */` comments, trailing commas, commas left out at line ends, single
quotes and unquoted text (https://hjson.github.io/syntax.html). tenfold reads it with the
same library the same way, so whatever DeepSpeed accepts is accepted here, and duplicate
keys are refused as DeepSpeed refuses them.

One step further: configs copied from Python code or from a page that prints Python's
literals (the recipe's own snippet writes `"enabled": True,`) would reach hjson as unquoted
*text*, "True," with its comma. A bare `True`, `False` or `None` in a value's place is
read as `true`, `false`, `null`, with one notice. Anything still malformed gets one line
naming the file, the line and what to change.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NamedTuple

from tenfold.errors import UserError
from tenfold.textfiles import read_text

_PYTHON = {"True": "true", "False": "false", "None": "null"}  # same lengths: columns stay put
_WORD = re.compile(r"[^\W\d]\w*")  # a word, in any script
_BEFORE_A_VALUE = {":", "[", ","}


class _Scan(NamedTuple):
    text: str  # with Python's literals spelled as JSON's
    python_literals: list[tuple[int, str]]  # (line, word) of each one replaced
    unquoted: list[tuple[int, str]]  # (line, text) of unquoted values that swallowed a bracket or quote


def _line_end(text: str, i: int) -> int:
    j = text.find("\n", i)
    return len(text) if j < 0 else j


def _string_end(text: str, i: int) -> int:
    """Index after the string starting at text[i] (a quote); at the line's end if unclosed."""
    if text.startswith("'''", i):  # hjson's multi-line string
        j = text.find("'''", i + 3)
        return len(text) if j < 0 else j + 3
    quote, j, end = text[i], i + 1, _line_end(text, i)
    while j < end and text[j] != quote:
        j += 2 if text[j] == "\\" else 1
    return min(j + 1, end)


def _comment_end(text: str, i: int) -> int | None:
    """Index after the comment starting at text[i], or None if none starts there."""
    if text[i] == "#" or text.startswith("//", i):
        return _line_end(text, i)
    if text.startswith("/*", i):
        j = text.find("*/", i + 2)
        return len(text) if j < 0 else j + 2
    return None


def _ends_a_value(rest: str) -> bool:
    rest = rest.lstrip(" \t\r")
    return not rest or rest[0] in ",}]#" or rest.startswith(("//", "/*"))


def scan(text: str) -> _Scan:
    """Find bare Python literals ending a value (outside strings and comments), and
    unquoted values that run over a bracket or quote; return the text with the literals
    replaced."""
    chars, literals, unquoted = list(text), [], []
    i, prev = 0, ""  # prev: the last significant character outside strings and comments
    while i < len(text):
        c = text[i]
        comment_end = _comment_end(text, i)
        if comment_end is not None:
            i = comment_end
        elif c in "\"'":
            i, prev = _string_end(text, i), '"'
        elif _WORD.match(text, i):
            word_end = _WORD.match(text, i).end()
            word, rest = text[i:word_end], text[word_end : _line_end(text, i)]
            line = text.count("\n", 0, i) + 1
            if word in _PYTHON and _ends_a_value(rest):  # a key would be followed by ':
                chars[i:word_end] = _PYTHON[word]
                literals.append((line, word))
                i, prev = word_end, "v"
            elif prev in _BEFORE_A_VALUE and not rest.lstrip().startswith(":") and not (
                word in _PYTHON.values() and _ends_a_value(rest)
            ):
                value = (word + rest).strip()  # hjson: unquoted text runs to the line's end
                if any(ch in value for ch in "{}[]\""):
                    unquoted.append((line, value))
                i, prev = _line_end(text, i), "v"
            else:  # a key, or a keyword such as true
                i, prev = word_end, "w"
        else:
            prev = c if not c.isspace() else prev
            i += 1
    return _Scan("".join(chars), literals, unquoted)


# hjson's message (its start) -> what to change
_HINTS = (
    ("Expecting ':' delimiter", "put a ':' between the key and its value"),
    ("Extra data", "delete what follows the config's closing '}' (or a '}' too many above it)"),
    ("Found ',' where a key name was expected", "delete the extra ','"),
    ("Unterminated string", "close the string with a '\"' on the same line"),
    ("Bad key name (eof)", "the file ends inside {...}: add the missing '}'"),
    ("End of input", "the file ends inside {...} or [...]: add the missing '}' or ']'"),
    ("Found a punctuator character", "close each '[' with ']' and each '{' with '}', or put the text in quotes"),
    ("Invalid \\X escape", "write a backslash inside a string as \\\\"),
    ("Expecting value", "write a value here: a number, \"text\", true, false, null, {...} or [...]"),
)
_DEFAULT_HINT = "check the brackets, quotes, colons and commas there"


def _syntax_error(p: Path, text: str, found: _Scan, e: Any) -> UserError:
    line = getattr(e, "lineno", None) or 1
    swallowed = [(n, v) for n, v in found.unquoted if n <= line]
    if swallowed:  # the usual cause of a confusing error further down: point at it instead
        n, value = swallowed[0]
        return UserError(
            f"malformed DeepSpeed config {p}, line {n}: {value[:60]!r} is read as text up to the end of "
            "the line (DeepSpeed reads hjson, where unquoted text runs to the line's end); write the value "
            'as JSON: a number, "quoted text", true, false or null'
        )
    msg = getattr(e, "msg", str(e))
    hint = next((h for start, h in _HINTS if msg.startswith(start)), _DEFAULT_HINT)
    source = text.splitlines()[line - 1].strip() if line <= len(text.splitlines()) else ""
    where = f"line {line} column {getattr(e, 'colno', 1)}"
    shown = f" in {source[:60]!r}" if source else ""
    return UserError(f"malformed DeepSpeed config {p}, {where}: {msg}{shown}; {hint}")


def _parse(p: Path, text: str, found: _Scan) -> Any:
    import hjson

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
        out: dict = {}
        for k, v in pairs:
            if k in out:
                raise UserError(f"duplicate key {k!r} in DeepSpeed config {p}; keep one (DeepSpeed refuses duplicates too)")
            out[k] = v
        return out

    try:
        return hjson.loads(found.text, object_pairs_hook=no_duplicates)
    except hjson.HjsonDecodeError as e:
        raise _syntax_error(p, text, found, e) from None
    except OverflowError:  # hjson turns 1e400 into an int and overflows
        raise UserError(f"malformed DeepSpeed config {p}: a number is out of range (above 1e308)") from None
    except RecursionError:
        raise UserError(f"malformed DeepSpeed config {p}: nested too deeply") from None


def _literals_notice(p: Path, literals: list[tuple[int, str]]) -> str:
    words = sorted({w for _, w in literals})
    lines = ", ".join(str(n) for n in sorted({n for n, _ in literals}))
    return (
        f"{p}: read Python's {'/'.join(words)} as JSON's {'/'.join(_PYTHON[w] for w in words)} "
        f"(line{'s' if ',' in lines else ''} {lines}); JSON writes true, false and null in lower case"
    )


def read_deepspeed_text(path: Path) -> tuple[dict, list[str]]:
    """The DeepSpeed config at `path` as a dict, and the notices about what was read leniently."""
    text = read_text(path, "DeepSpeed config")
    if not text.strip():
        raise UserError(f"DeepSpeed config {path} is empty; expected a JSON object {{...}}")
    found = scan(text)
    config = _parse(path, text, found)
    if not isinstance(config, dict):
        raise UserError(f"DeepSpeed config {path} must be a JSON object {{...}}, got a {type(config).__name__}")
    notices = [_literals_notice(path, found.python_literals)] if found.python_literals else []
    return config, notices
