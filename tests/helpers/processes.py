"""Processes seen through /proc: who is whose child, and who is still alive (not a zombie)."""

from __future__ import annotations

from pathlib import Path


def _live_parents() -> dict[int, list[int]]:
    """parent pid -> its live (non-zombie) children."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parents.setdefault(int(fields[1]), []).append(int(entry.name))
    return parents


def children_of(pid: int) -> list[int]:
    """Live direct children of `pid`."""
    return _live_parents().get(pid, [])


def descendants(pid: int) -> list[int]:
    """Live descendants of `pid`, at any depth."""
    parents = _live_parents()
    found, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
