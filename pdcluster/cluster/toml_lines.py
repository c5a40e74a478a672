"""Where each table and key of a TOML text starts, so errors about its values can name the line.

`tomllib` gives values but no positions; this scanner reads the same text line by line and maps a
key path to its line: `("router", "http_port")`, `("nodes", 1)` (the second `[[nodes]]` header),
`("nodes", 1, "devices")`. It follows strings, comments, multi-line arrays and inline tables well
enough for that; the values themselves always come from `tomllib`.
"""

from __future__ import annotations

Path_ = tuple[str | int, ...]


def _split_key(text: str) -> list[str]:
    """`a."b.c".d` -> ["a", "b.c", "d"]."""
    parts, current, quote = [], "", ""
    for char in text:
        if quote:
            if char == quote:
                quote = ""
            else:
                current += char
        elif char in "\"'":
            quote = char
        elif char == ".":
            parts.append(current.strip())
            current = ""
        else:
            current += char
    parts.append(current.strip())
    return parts


def _code(line: str) -> tuple[str, int]:
    """The line without its comment, and how much it opens brackets (closing ones count negative)."""
    out, quote, depth, index = "", "", 0, 0
    while index < len(line):
        char = line[index]
        index += 1
        if quote:
            if char == "\\" and quote == '"':  # an escaped character never ends the string
                out += line[index - 1:index + 1]
                index += 1
                continue
            if char == quote:
                quote = ""
        elif char in "\"'":
            quote = char
        elif char == "#":
            break
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        out += char
    return out, depth


def locate(text: str) -> dict[Path_, int]:
    """Key path -> 1-based line number of every table header and key in `text`."""
    lines: dict[Path_, int] = {}
    table: Path_ = ()
    arrays: dict[tuple[str, ...], int] = {}
    depth = 0
    multiline = ""
    for number, raw in enumerate(text.splitlines(), 1):
        if multiline:
            if multiline in raw:
                multiline = ""
            continue
        code, opened = _code(raw)
        if depth > 0:  # inside a multi-line array or inline table started above
            depth += opened
            continue
        stripped = code.strip()
        if not stripped:
            continue
        if stripped.startswith("[["):
            name = tuple(_split_key(stripped[2:stripped.index("]]")]))
            index = arrays.get(name, 0)
            arrays[name] = index + 1
            table = (*name, index)
            lines[table] = number
        elif stripped.startswith("["):
            table = tuple(_split_key(stripped[1:stripped.index("]")]))
            lines[table] = number
        elif "=" in stripped:
            key, _, value = stripped.partition("=")
            lines[(*table, *_split_key(key))] = number
            depth = max(0, opened)
            for delimiter in ('"""', "'''"):
                if value.count(delimiter) == 1:
                    multiline = delimiter
    return lines


def line_of(lines: dict[Path_, int], path: Path_) -> int:
    """The line of `path`, else of its nearest enclosing table or key found (0: unknown)."""
    while path:
        if path in lines:
            return lines[path]
        path = path[:-1]
    return 0
