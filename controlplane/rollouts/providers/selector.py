"""Field selectors: a tiny, safe subset of JSONPath that picks one value out of a JSON answer.

Grammar: ``$`` followed by up to 32 steps, each ``.name`` (letters, digits, ``_``, ``-``),
``['name']`` / ``["name"]`` (any key; ``\\`` escapes the quote or a backslash) or ``[N]`` (a list
index, negative from the end). ``$`` alone selects the whole answer. Examples::

    $.result                 $.metrics['error-rate'].canary        $.samples[-1]

No wildcards, filters, slices, recursive descent or expressions: a selector names exactly one
place, is parsed once when the spec is read, and walking it costs one step per segment. A place
that is not there (missing key, index out of range, a key asked of a list) selects ``None``,
which the analysis counts as no data — never as a success.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from controlplane.rollouts.providers.base import ProviderSpecError

__all__ = ["MAX_SELECTOR_STEPS", "FieldSelector", "parse_selector"]

MAX_SELECTOR_STEPS = 32
_NAME = re.compile(r"\.([A-Za-z_][A-Za-z0-9_-]*)")
_INDEX = re.compile(r"\[(-?\d{1,9})\]")
_QUOTED = re.compile(r"""\[(['"])((?:\\.|(?!\1)[^\\])*)\1\]""")


@dataclass(frozen=True)
class FieldSelector:
    """A parsed selector: ``steps`` are keys (str) and list indexes (int)."""

    text: str
    steps: tuple[str | int, ...]

    def select(self, document: object) -> object:
        """The selected value, or None when the place does not exist in ``document``."""
        value = document
        for step in self.steps:
            if isinstance(step, str):
                if not isinstance(value, Mapping) or step not in value:
                    return None
                value = value[step]
            else:
                if not isinstance(value, Sequence) or isinstance(value, str | bytes):
                    return None
                if not -len(value) <= step < len(value):
                    return None
                value = value[step]
        return value


def parse_selector(text: object, where: str) -> FieldSelector:
    """Check ``text``; raise :class:`ProviderSpecError` naming ``where`` and the column when it is not allowed."""
    if not isinstance(text, str) or not text.startswith("$"):
        raise ProviderSpecError(
            f"{where}: expected a field selector starting with '$' such as '$.result', got {text!r}"
        )
    if len(text) > 512:
        raise ProviderSpecError(f"{where}: the selector is {len(text)} characters; the limit is 512")
    steps: list[str | int] = []
    position = 1
    while position < len(text):
        if match := _NAME.match(text, position):
            steps.append(match.group(1))
        elif match := _INDEX.match(text, position):
            steps.append(int(match.group(1)))
        elif match := _QUOTED.match(text, position):
            steps.append(re.sub(r"\\(.)", r"\1", match.group(2)))
        else:
            raise ProviderSpecError(
                f"{where}: cannot read {text!r} at column {position + 1}; a selector is '$' followed by "
                ".name, ['name'] or [index] steps (no wildcards, filters or slices)"
            )
        position = match.end()
        if len(steps) > MAX_SELECTOR_STEPS:
            raise ProviderSpecError(f"{where}: more than {MAX_SELECTOR_STEPS} steps in {text!r}")
    return FieldSelector(text, tuple(steps))
