"""The command lines' argument parser: argparse that takes no abbreviations and names the nearest known flag.

A prefix argparse would silently take (``--num-spec 3``) is a guess about what the user meant, and a guess that
changes meaning the day another flag with the same prefix is added; so every flag is spelled out. A flag no
parser knows is an error naming the closest one (``--prot``: did you mean ``--port``?), as a user coming from vLLM
or llama.cpp gets their spelling nearly right.
"""
from __future__ import annotations

import argparse
import difflib
from typing import Any, Sequence


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with ``allow_abbrev=False`` and unknown flags answered with the nearest known."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(unknown_message(extras, self.flags()))
        return parsed

    def flags(self) -> list[str]:
        """Every option string this parser takes (``--port``, ``-h``, ...)."""
        return [flag for action in self._actions for flag in action.option_strings]


def unknown_message(extras: Sequence[str], known: Sequence[str]) -> str:
    """What argparse left over, each unknown flag with the nearest known one where one is near."""
    parts: list[str] = []
    after_flag = False
    for extra in extras:
        flag = extra.split("=", 1)[0]
        if not flag.startswith("-") or flag == "-":
            if not after_flag:        # (a word right after an unknown flag is taken as its value)
                parts.append(f"unexpected argument {extra!r}")
            after_flag = False
            continue
        after_flag = "=" not in extra
        # an abbreviation names the flags it begins; a misspelling, the closest one
        nearest = [k for k in known if k.startswith(flag)] if flag.startswith("--") and len(flag) > 3 else []
        nearest = nearest or difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        parts.append(f"unknown flag {flag}" + (f" (did you mean {' or '.join(nearest)}?)" if nearest else ""))
    return "; ".join(parts)
