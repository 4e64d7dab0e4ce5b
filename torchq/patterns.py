"""Regular expressions from files, matched in linear time.

Checkpoint config files name modules with regular expressions (compressed-tensors ``"re:<regex>"``
``targets`` / ``ignore`` entries, torchq plan keys ``"re:<regex>"``). Such a file may be hostile, and
Python's ``re`` backtracks: ``re.match("(.|.)*Z", "a" * 40)`` runs for minutes. :func:`compile_pattern`
accepts Python's own syntax (it parses with ``re``'s parser) and builds a Thompson NFA of bounded size;
:class:`SafePattern` simulates the set of active states, in time ``O(len(text) × states)`` and never
backtracks, with the truth values of ``re.match`` / ``re.fullmatch`` / ``re.search``.

Supported: literals, ``.``, character classes (ranges, negation, ``\\d \\w \\s \\D \\W \\S``), groups
(captures are ignored), alternation, ``* + ? {m,n}`` greedy and lazy, the anchors ``^ $ \\A \\Z``, word
boundaries ``\\b \\B``, and the flags ``(?i) (?s) (?m) (?x) (?a) (?u)``, global or scoped. Each
single-character test is Python's own (a one-character regex, which cannot backtrack), so case folding
and Unicode classes are exactly ``re``'s.

Refused with a :class:`PatternError`: backreferences, lookahead / lookbehind, conditionals, atomic
groups and possessive quantifiers (none of them fits a finite automaton), patterns longer than
:data:`MAX_PATTERN_LENGTH` characters or nested deeper than :data:`MAX_NESTING`, and patterns whose
automaton would exceed :data:`MAX_STATES` states (``a{1000}{1000}``), so memory stays bounded.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

try:  # Python 3.11+
    from re import _constants as _sre_c  # type: ignore[attr-defined]
    from re import _parser as _sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - older Pythons
    import sre_constants as _sre_c  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

__all__ = ["PatternError", "SafePattern", "compile_pattern", "check_total_states", "MAX_PATTERN_LENGTH", "MAX_STATES",
           "MAX_TOTAL_STATES", "MAX_NESTING"]

MAX_PATTERN_LENGTH = 4096
MAX_STATES = 1_000  # per pattern: real module-name patterns use under 100
MAX_TOTAL_STATES = 2_000  # per file or plan: each module name is matched against every pattern
MAX_NESTING = 100
_CACHE_BUDGET = 50_000  # NFA states held by one pattern's memo of transitions (then it starts afresh)


class PatternError(ValueError):
    """A regular expression from a file that is invalid or that the linear-time matcher refuses.

    ``where`` names its place in the file, ``pattern`` is the expression, ``reason`` says what is wrong."""

    def __init__(self, where: str, pattern: str, reason: str, message: str | None = None):
        self.where, self.pattern, self.reason = where, pattern, reason
        shown = repr(pattern) if len(repr(pattern)) <= 200 else f"{repr(pattern)[:200]}... ({len(pattern)} characters)"
        super().__init__(message or f"{where}: regular expression {shown}: {reason}")


class _Refused(Exception):
    """Internal: the reason a pattern is refused (compile_pattern adds ``where``)."""


# -- the automaton ------------------------------------------------------------------------------------------
_CHAR, _EPS, _ASSERT, _MATCH = range(4)

# zero-width assertions, as bits of a position's context mask
_BEG, _BOL, _END_STRING, _END, _EOL, _UNI_B, _UNI_NB, _ASCII_B, _ASCII_NB = range(9)

_MAXREPEAT = int(_sre_c.MAXREPEAT)
_I, _S, _M, _A, _U = re.IGNORECASE, re.DOTALL, re.MULTILINE, re.ASCII, re.UNICODE
_TYPE_FLAGS = re.ASCII | re.LOCALE | re.UNICODE

_CATEGORIES = {
    "CATEGORY_DIGIT": r"\d", "CATEGORY_NOT_DIGIT": r"\D", "CATEGORY_SPACE": r"\s",
    "CATEGORY_NOT_SPACE": r"\S", "CATEGORY_WORD": r"\w", "CATEGORY_NOT_WORD": r"\W",
}
_REFUSED = {
    "GROUPREF": "a backreference", "GROUPREF_IGNORE": "a backreference", "GROUPREF_UNI_IGNORE": "a backreference",
    "GROUPREF_LOC_IGNORE": "a backreference", "GROUPREF_EXISTS": "a conditional group (?(...)...|...)",
    "ATOMIC_GROUP": "an atomic group (?>...)", "POSSESSIVE_REPEAT": "a possessive quantifier (*+ ++ ?+ {m,n}+)",
}

_UNI_WORD = re.compile(r"\w").match
_ASCII_WORD = re.compile(r"(?a)\w").match
_EMPTY_B = re.match(r"\b", "") is not None  # \b and \B on "": never before Python 3.14, \B since
_EMPTY_NB = re.match(r"\B", "") is not None


def _name(code: Any) -> str:
    """The name of a parse-tree code (opcodes, anchors and categories share int values)."""
    return getattr(code, "name", None) or str(code)


def _never(ch: str) -> bool:
    return False


def _always(ch: str) -> bool:
    return True


def _esc(cp: int) -> str:
    return f"\\U{cp:08x}"


class _Builder:
    """Parse tree -> NFA; each construct is built backwards from its continuation state."""

    def __init__(self) -> None:
        self.kind: list[int] = []
        self.outs: list[tuple[int, ...]] = []
        self.arg: list[int] = []
        self.preds: list[Callable[[str], Any]] = []
        self.assert_bits = 0
        self._pred_cache: dict[str, Callable[[str], Any]] = {}

    def new(self, kind: int, outs: tuple[int, ...] = (), arg: int = 0, pred: Callable[[str], Any] = _never) -> int:
        if len(self.kind) >= MAX_STATES:
            raise _Refused(f"its automaton would exceed {MAX_STATES} states (a large {{m,n}} repeat?)")
        self.kind.append(kind)
        self.outs.append(outs)
        self.arg.append(arg)
        self.preds.append(pred)
        return len(self.kind) - 1

    def char_pred(self, op: str, av: Any, flags: int) -> Callable[[str], Any]:
        """A test of one character; Python's own for anything but plain literals and dots."""
        if op == "LITERAL" and (not flags & _I or (av < 128 and not chr(av).isalpha())):
            return chr(av).__eq__
        if op == "NOT_LITERAL" and (not flags & _I or (av < 128 and not chr(av).isalpha())):
            return chr(av).__ne__
        if op == "ANY":
            return _always if flags & _S else "\n".__ne__
        if op == "LITERAL":
            body = _esc(av)
        elif op == "NOT_LITERAL":
            body = f"[^{_esc(av)}]"
        else:  # IN
            items, negate = list(av), False
            if items and _name(items[0][0]) == "NEGATE":
                items, negate = items[1:], True
            parts = []
            for iop, iav in items:
                name = _name(iop)
                if name == "LITERAL":
                    parts.append(_esc(iav))
                elif name == "RANGE":
                    parts.append(f"{_esc(iav[0])}-{_esc(iav[1])}")
                elif name == "CATEGORY" and _name(iav) in _CATEGORIES:
                    parts.append(_CATEGORIES[_name(iav)])
                else:
                    raise _Refused(f"unsupported character class item {name}")
            if not parts:
                return _always if negate else _never
            body = f"[{'^' if negate else ''}{''.join(parts)}]"
        prefix = "".join(f for f, bit in (("i", _I), ("s", _S), ("a", _A)) if flags & bit)
        text = f"(?{prefix}){body}" if prefix else body
        pred = self._pred_cache.get(text)
        if pred is None:
            pred = self._pred_cache[text] = re.compile(text).match
        return pred

    def seq(self, items: Any, flags: int, nxt: int, depth: int) -> int:
        for item in reversed(list(items)):
            nxt = self.item(item, flags, nxt, depth)
        return nxt

    def item(self, item: Any, flags: int, nxt: int, depth: int) -> int:
        op, av = item
        name = _name(op)
        if name in ("LITERAL", "NOT_LITERAL", "ANY", "IN"):
            return self.new(_CHAR, (nxt,), pred=self.char_pred(name, av, flags))
        if name == "SUBPATTERN":
            _group, add, remove, sub = av
            if add & _TYPE_FLAGS:
                flags &= ~_TYPE_FLAGS
            return self.seq(sub, (flags | add) & ~remove, nxt, depth + 1)
        if name == "BRANCH":
            starts = tuple(self.seq(alt, flags, nxt, depth + 1) for alt in av[1])
            return self.new(_EPS, starts)
        if name in ("MAX_REPEAT", "MIN_REPEAT"):  # greediness does not change which texts match
            lo, hi, sub = av
            cur = nxt
            if hi == _MAXREPEAT:  # sub{lo} sub*
                loop = self.new(_EPS)
                self.outs[loop] = (self.seq(sub, flags, loop, depth + 1), nxt)
                cur = loop
            else:  # sub{lo} (sub (sub ...)?)?
                for _ in range(hi - lo):
                    cur = self.new(_EPS, (self.seq(sub, flags, cur, depth + 1), nxt))
            for _ in range(lo):
                before = len(self.kind)
                cur = self.seq(sub, flags, cur, depth + 1)
                if len(self.kind) == before:  # an empty body: (?:){10**9} is (?:)
                    break
            return cur
        if name == "AT":
            at = _name(av)
            multiline, ascii_ = bool(flags & _M), not flags & _U
            bit = {
                "AT_BEGINNING": _BOL if multiline else _BEG, "AT_BEGINNING_LINE": _BOL, "AT_BEGINNING_STRING": _BEG,
                "AT_END": _EOL if multiline else _END, "AT_END_LINE": _EOL, "AT_END_STRING": _END_STRING,
                "AT_BOUNDARY": _ASCII_B if ascii_ else _UNI_B, "AT_NON_BOUNDARY": _ASCII_NB if ascii_ else _UNI_NB,
            }.get(at)
            if bit is None:
                raise _Refused(f"unsupported anchor {at}")
            self.assert_bits |= 1 << bit
            return self.new(_ASSERT, (nxt,), arg=bit)
        if name in ("ASSERT", "ASSERT_NOT"):
            direction = "lookahead" if av[0] >= 0 else "lookbehind"
            raise _Refused(f"a {'negative ' if name == 'ASSERT_NOT' else ''}{direction} assertion is not supported")
        if name in _REFUSED:
            raise _Refused(f"{_REFUSED[name]} is not supported")
        raise _Refused(f"unsupported construct {name}")


def _depth(tree: Any) -> int:
    """Nesting depth of a parse tree, without recursion."""
    deepest, stack = 0, [(tree, 0)]
    while stack:
        node, d = stack.pop()
        deepest = max(deepest, d)
        if d > MAX_NESTING:
            break
        for op, av in node:
            name = _name(op)
            if name == "SUBPATTERN":
                stack.append((av[3], d + 1))
            elif name == "BRANCH":
                stack.extend((alt, d + 1) for alt in av[1])
            elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
                stack.append((av[2], d + 1))
    return deepest


class SafePattern:
    """A compiled pattern: :meth:`match`, :meth:`fullmatch` and :meth:`search` return what
    ``re.match(...) is not None`` (etc.) would, without backtracking. ``pattern``: the source."""

    def __init__(self, pattern: str, b: _Builder, start: int):
        self.pattern = pattern
        self._kind, self._outs, self._arg, self._preds = b.kind, b.outs, b.arg, b.preds
        self._start = frozenset((start,))
        self._assert_bits = b.assert_bits
        self._match_state = b.kind.index(_MATCH)
        self._memo: dict[tuple, frozenset[int]] = {}
        self._memo_cost = 0

    def __repr__(self) -> str:
        return f"SafePattern({self.pattern!r}, states={len(self._kind)})"

    @property
    def num_states(self) -> int:
        return len(self._kind)

    def match(self, text: str) -> bool:
        """``re.match(pattern, text) is not None``: a match starting at 0, ending anywhere."""
        return self._run(text, 0)

    def fullmatch(self, text: str) -> bool:
        """``re.fullmatch(pattern, text) is not None``."""
        return self._run(text, 1)

    def search(self, text: str) -> bool:
        """``re.search(pattern, text) is not None``."""
        return self._run(text, 2)

    def _context(self, text: str, i: int, n: int) -> int:
        """The assertions that hold at position ``i`` (only those the pattern uses)."""
        bits = self._assert_bits
        prev = text[i - 1] if i > 0 else ""
        cur = text[i] if i < n else ""
        m = 0
        if i == 0:
            m |= 1 << _BEG | 1 << _BOL
        elif prev == "\n":
            m |= 1 << _BOL
        if i == n:
            m |= 1 << _END_STRING | 1 << _END | 1 << _EOL
        elif cur == "\n":
            m |= 1 << _EOL | (1 << _END if i == n - 1 else 0)
        for b, nb, word in ((_UNI_B, _UNI_NB, _UNI_WORD), (_ASCII_B, _ASCII_NB, _ASCII_WORD)):
            if bits & (1 << b | 1 << nb):
                if n == 0:
                    m |= (_EMPTY_B << b) | (_EMPTY_NB << nb)
                else:
                    m |= 1 << (b if bool(prev and word(prev)) != bool(cur and word(cur)) else nb)
        return m & bits

    def _closure(self, raw: frozenset[int] | list[int], mask: int) -> frozenset[int]:
        """The character-consuming (and match) states reachable from ``raw`` by empty moves at a
        position whose assertions are ``mask``."""
        kind, outs, arg = self._kind, self._outs, self._arg
        seen: set[int] = set()
        found = []
        stack = list(raw)
        while stack:
            s = stack.pop()
            if s in seen:
                continue
            seen.add(s)
            k = kind[s]
            if k == _EPS:
                stack.extend(outs[s])
            elif k == _ASSERT:
                if mask >> arg[s] & 1:
                    stack.append(outs[s][0])
            else:
                found.append(s)
        return frozenset(found)

    def _run(self, text: str, mode: int) -> bool:  # mode: 0 match, 1 fullmatch, 2 search
        if not isinstance(text, str):
            raise TypeError(f"SafePattern: expected a str, got {type(text).__name__}")
        n = len(text)
        ctx = self._context if self._assert_bits else None
        search, full = mode == 2, mode == 1
        accept, memo, preds, outs = self._match_state, self._memo, self._preds, self._outs
        cur = self._closure(self._start, ctx(text, 0, n) if ctx else 0)
        for i, ch in enumerate(text):
            if accept in cur and not full:
                return True
            if not cur and not search:
                return False
            mask = ctx(text, i + 1, n) if ctx else 0
            key = (cur, ch, mask, search)
            nxt = memo.get(key)
            if nxt is None:
                raw = [outs[s][0] for s in cur if preds[s](ch)]
                if search:
                    raw.extend(self._start)
                nxt = self._closure(raw, mask)
                self._memo_cost += len(nxt) + len(cur) + 1
                if self._memo_cost > _CACHE_BUDGET:
                    memo.clear()
                    self._memo_cost = 0
                memo[key] = nxt
            cur = nxt
        return accept in cur


@functools.lru_cache(maxsize=128)
def _compile(pattern: str) -> SafePattern:
    if len(pattern) > MAX_PATTERN_LENGTH:
        raise _Refused(f"longer than {MAX_PATTERN_LENGTH} characters ({len(pattern)})")
    try:
        tree = _sre_parse.parse(pattern, 0)
    except re.error as e:
        raise _Refused(str(e)) from None
    except RecursionError:
        raise _Refused(f"nested deeper than {MAX_NESTING} levels") from None
    if _depth(tree) > MAX_NESTING:
        raise _Refused(f"nested deeper than {MAX_NESTING} levels")
    flags = tree.state.flags if hasattr(tree, "state") else tree.pattern.flags
    if flags & re.LOCALE:  # pragma: no cover - refused by the parser for str patterns
        raise _Refused("the LOCALE flag is not supported")
    b = _Builder()
    start = b.seq(tree, flags, b.new(_MATCH), 0)
    return SafePattern(pattern, b, start)


def compile_pattern(pattern: str, *, where: str) -> SafePattern:
    """Compile a regular expression read from a file (Python's syntax) to a :class:`SafePattern`.

    Raises :class:`PatternError` (a ValueError naming ``where``, the pattern and the reason) for an
    invalid pattern (``re.error``'s message), a construct the linear-time matcher refuses
    (backreferences, lookaround, conditionals, atomic groups, possessive quantifiers), or one too
    large (see the module docstring). Compiled patterns are cached."""
    if not isinstance(pattern, str):
        raise PatternError(where, pattern, f"expected a str, got {type(pattern).__name__}")
    try:
        return _compile(pattern)
    except _Refused as e:
        raise PatternError(where, pattern, str(e)) from None


def check_total_states(patterns: list[SafePattern], *, where: str) -> None:
    """PatternError unless ``patterns`` (all matched against every name of a model) hold at most
    :data:`MAX_TOTAL_STATES` states together: matching is linear in each, but a file listing many
    large patterns would still multiply the work by their number."""
    total = sum(p.num_states for p in patterns)
    if total > MAX_TOTAL_STATES:
        raise PatternError(where, "", "too many states", f"{where}: its patterns hold {total} automaton states together, "
                           f"more than {MAX_TOTAL_STATES}; use fewer or simpler patterns")
