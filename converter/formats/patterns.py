"""Regular expressions from quant configs, matched in bounded time.

GPTQModel's ``dynamic`` keys and compressed-tensors' ``re:`` targets and ``ignore``
entries are regexes that the producers match with Python's ``re.match``.  A config is
untrusted input, and ``re`` backtracks without bound: a 35-byte pattern such as
``(.*)*(.*)*(.*)*(.*)*(.*)*X`` runs for hours against one module name.  We match with
the ``regex`` package instead, whose default (``VERSION0``) syntax and ``match``
semantics are ``re``'s, which avoids most such blow-ups by itself and takes a timeout
for the rest: each pattern gets :data:`MATCH_BUDGET_S` seconds over all the names it is
matched against, and a pattern that uses them up is refused by name.
"""

from __future__ import annotations

import time
from pathlib import Path

import regex

from ..errors import ConfigError

#: Seconds one config pattern may spend matching, over every module name of a checkpoint
#: (real patterns need microseconds per name).
MATCH_BUDGET_S = 5.0


class ConfigPattern:
    """One regex of a quant config, compiled, with its own time budget.

    Args:
        pattern: the regular expression (``re`` syntax).
        entry: how messages name it (``key '-:.*proj'`` for a ``dynamic`` key, ``'re:.*'``
            for an ``ignore`` entry).
        field: the config field it sits in (``dynamic``, ``ignore``, ...).
        path: the config file.

    Raises:
        ConfigError: not a valid regular expression (naming the entry and the field).
    """

    def __init__(self, pattern: str, *, entry: str, field: str, path: Path) -> None:
        self.entry, self.field, self.path = entry, field, path
        try:
            self._rx = regex.compile(pattern)
        except (regex.error, ValueError, OverflowError, RecursionError) as exc:
            raise ConfigError(f"{entry} is not a valid regular expression ({exc})", path=path, tensor=field) from None
        self._left = MATCH_BUDGET_S

    def match(self, name: str) -> bool:
        """``re.match(pattern, name) is not None``, in bounded time.

        Raises:
            ConfigError: the pattern has used up its time budget (naming the entry, the
                field and the module it was being matched against).
        """
        start = time.monotonic()
        try:
            return self._rx.match(name, timeout=max(self._left, 1e-3)) is not None
        except TimeoutError:
            self._left = 0.0
            raise ConfigError(
                f"{self.entry} takes more than {MATCH_BUDGET_S:g} s to match module names (stopped at {name!r}): "
                "catastrophic backtracking; simplify the regular expression",
                path=self.path,
                tensor=self.field,
            ) from None
        finally:
            self._left -= time.monotonic() - start
