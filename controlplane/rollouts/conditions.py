"""Success and failure conditions: a small, safe expression language over one value, ``result``.

A condition is text such as ``result[0] <= 0.01`` or
``len(result) > 0 and result['canary'] - result['stable'] < 0.005``. It is parsed with Python's
``ast`` module and then *interpreted* by this module, node by node, against a strict whitelist;
nothing is ever passed to ``eval``/``exec``/``compile``. What the language holds:

- the name ``result`` (the provider's value: a number, a list, or a mapping with string keys);
- numbers, ``True``/``False``, and string constants (for mapping keys and equality);
- indexing ``result[0]``, ``result[-1]``, ``result['p99']`` with a constant index;
- arithmetic ``+ - * / %`` and unary ``-``/``+`` on numbers only (no ``**``: ``10**10**10`` is a
  denial of service, and strings or lists never multiply);
- comparisons ``< <= > >= == !=`` (chains allowed) between numbers, or ``==``/``!=`` between
  strings;
- ``and``, ``or``, ``not`` over conditions;
- the functions ``len``, ``abs``, ``min``, ``max`` and ``isnan``, called with positional
  arguments only.

Anything else (attribute access, other names, lambdas, comprehensions, ``**``, calls of anything
but the five functions, f-strings, walrus, slices) is refused when the spec is read, with the
position and a hint. A condition must be a condition: its top is a comparison, ``and``/``or``/
``not``, ``isnan(...)`` or ``True``/``False``; ``result[0]`` alone is refused rather than
silently read as truthiness. Errors at evaluation time (an index out of range, a string where a
number is needed) raise :class:`ConditionEvaluationError`, which the analysis counts as a
measurement *Error*, never as a success.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weightship.errors import ValidationError, WeightshipError

__all__ = ["Condition", "ConditionError", "ConditionEvaluationError", "compile_condition"]

#: Conditions are short; a bound on text and tree size keeps parsing and evaluation cheap.
MAX_CONDITION_CHARS = 1000
MAX_CONDITION_NODES = 200

_COMPARATORS: dict[type[ast.cmpop], Callable[[Any, Any], bool]] = {
    ast.Lt: lambda a, b: bool(a < b),
    ast.LtE: lambda a, b: bool(a <= b),
    ast.Gt: lambda a, b: bool(a > b),
    ast.GtE: lambda a, b: bool(a >= b),
    ast.Eq: lambda a, b: bool(a == b),
    ast.NotEq: lambda a, b: bool(a != b),
}
_ARITHMETIC: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.Mod: lambda a, b: a % b,
}
_FUNCTIONS = frozenset({"len", "abs", "min", "max", "isnan"})
_BOOLEAN_FUNCTIONS = frozenset({"isnan"})


class ConditionError(ValidationError):
    """A condition's text is not in the expression language; fix the spec."""


class ConditionEvaluationError(WeightshipError):
    """A valid condition could not be evaluated against this result (counted as a measurement Error)."""


@dataclass(frozen=True)
class Condition:
    """A parsed, checked condition; :meth:`evaluate` interprets it against one ``result``."""

    text: str
    _tree: ast.expr

    def evaluate(self, result: object) -> bool:
        """True or False for this ``result``; raises :class:`ConditionEvaluationError`."""
        value = _evaluate(self._tree, result)
        if not isinstance(value, bool):  # pragma: no cover - the static check guarantees a boolean
            raise ConditionEvaluationError(f"condition {self.text!r} gave {value!r}, not true or false")
        return value


def compile_condition(text: str, *, where: str = "condition") -> Condition:
    """Parse and check ``text``; raise :class:`ConditionError` naming ``where`` when it is not allowed."""
    if not isinstance(text, str) or not text.strip():
        raise ConditionError(f"{where}: a condition must be non-empty text such as 'result[0] < 0.01'")
    if len(text) > MAX_CONDITION_CHARS:
        raise ConditionError(f"{where}: condition is {len(text)} characters; the limit is {MAX_CONDITION_CHARS}")
    for argo, ours in (("&&", "and"), ("||", "or")):
        if argo in text:
            raise ConditionError(f"{where}: {argo!r} is not supported in {text!r}; write {ours!r} instead")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise ConditionError(
            f"{where}: {text!r} is not a valid expression ({exc.msg} at column {exc.offset})"
        ) from None
    nodes = sum(1 for _ in ast.walk(tree))
    if nodes > MAX_CONDITION_NODES:
        raise ConditionError(f"{where}: condition has {nodes} syntax nodes; the limit is {MAX_CONDITION_NODES}")
    _check(tree.body, text, where)
    if not _is_boolean(tree.body):
        raise ConditionError(f"{where}: {text!r} is a value, not a condition; compare it, e.g. '{text.strip()} > 0'")
    return Condition(text=text, _tree=tree.body)


def _refuse(node: ast.AST, text: str, where: str, what: str) -> ConditionError:
    column = getattr(node, "col_offset", 0) + 1
    allowed = "result, numbers, [index], + - * / %, comparisons, and/or/not, len/abs/min/max/isnan"
    return ConditionError(f"{where}: {what} is not allowed (column {column} of {text!r}); allowed: {allowed}")


def _check(node: ast.AST, text: str, where: str) -> None:
    """Refuse every node type outside the whitelist, recursively."""
    match node:
        case ast.Constant(value=value):
            if value is None or isinstance(value, bytes | complex) or value is Ellipsis:
                raise _refuse(node, text, where, f"the constant {value!r}")
        case ast.Name(id=name):
            if name != "result":
                raise _refuse(node, text, where, f"the name {name!r}")
        case ast.Subscript(value=value, slice=index):
            _check(value, text, where)
            if not _is_constant_index(index):
                raise _refuse(node, text, where, "an index that is not a constant number or string")
        case ast.BinOp(left=left, op=op, right=right):
            if type(op) not in _ARITHMETIC:
                raise _refuse(node, text, where, f"the operator {type(op).__name__}")
            _check(left, text, where)
            _check(right, text, where)
        case ast.UnaryOp(op=op, operand=operand):
            if not isinstance(op, ast.USub | ast.UAdd | ast.Not):
                raise _refuse(node, text, where, f"the operator {type(op).__name__}")
            if isinstance(op, ast.Not) and not _is_boolean(operand):
                raise _refuse(node, text, where, "'not' of a value (negate a comparison instead)")
            _check(operand, text, where)
        case ast.BoolOp(values=values):
            for value in values:
                if not _is_boolean(value):
                    raise _refuse(value, text, where, "'and'/'or' over a value (combine comparisons instead)")
                _check(value, text, where)
        case ast.Compare(left=left, ops=ops, comparators=comparators):
            for comparison in ops:
                if type(comparison) not in _COMPARATORS:
                    raise _refuse(node, text, where, f"the comparison {type(comparison).__name__}")
            for operand in (left, *comparators):
                _check(operand, text, where)
        case ast.Call(func=ast.Name(id=name), args=args, keywords=[]) if name in _FUNCTIONS:
            if any(isinstance(arg, ast.Starred) for arg in args) or not args:
                raise _refuse(node, text, where, f"this call of {name}()")
            for arg in args:
                _check(arg, text, where)
        case ast.Call():
            raise _refuse(node, text, where, "a call of anything but len, abs, min, max, isnan")
        case ast.Attribute():
            raise _refuse(node, text, where, "attribute access")
        case ast.Lambda():
            raise _refuse(node, text, where, "a lambda")
        case ast.ListComp() | ast.SetComp() | ast.DictComp() | ast.GeneratorExp():
            raise _refuse(node, text, where, "a comprehension")
        case _:
            raise _refuse(node, text, where, f"a {type(node).__name__} expression")


def _is_constant_index(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, int | str) and not isinstance(node.value, bool)
    return (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub)
        and isinstance(node.operand, ast.Constant)
        and type(node.operand.value) is int
    )


def _is_boolean(node: ast.expr) -> bool:
    """Whether a checked node always yields a boolean."""
    match node:
        case ast.Compare() | ast.BoolOp():
            return True
        case ast.UnaryOp(op=ast.Not()):
            return True
        case ast.Constant(value=value):
            return isinstance(value, bool)
        case ast.Call(func=ast.Name(id=name)):
            return name in _BOOLEAN_FUNCTIONS
    return False


def _number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConditionEvaluationError(f"{what} needs a number, got {_describe(value)}")
    return value


def _describe(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'…' if len(text) > 60 else ''}"


def _evaluate(node: ast.expr, result: object) -> Any:
    """Interpret one whitelisted node; only nodes that :func:`_check` let through arrive here."""
    match node:
        case ast.Constant(value=value):
            return value
        case ast.Name():
            return result
        case ast.Subscript(value=container_node, slice=index_node):
            return _index(_evaluate(container_node, result), _evaluate(index_node, result))
        case ast.BinOp(left=left, op=op, right=right):
            a = _number(_evaluate(left, result), type(op).__name__)
            b = _number(_evaluate(right, result), type(op).__name__)
            try:
                return _ARITHMETIC[type(op)](a, b)
            except ZeroDivisionError:
                raise ConditionEvaluationError("division by zero") from None
        case ast.UnaryOp(op=ast.Not(), operand=operand):
            return not _evaluate(operand, result)
        case ast.UnaryOp(op=op, operand=operand):
            value = _number(_evaluate(operand, result), "unary minus")
            return -value if isinstance(op, ast.USub) else value
        case ast.BoolOp(op=op, values=values):
            if isinstance(op, ast.And):
                return all(_evaluate(value, result) for value in values)
            return any(_evaluate(value, result) for value in values)
        case ast.Compare(left=left, ops=ops, comparators=comparators):
            a = _evaluate(left, result)
            for comparison, comparator in zip(ops, comparators, strict=True):
                b = _evaluate(comparator, result)
                if not _comparable(a, b, comparison):
                    raise ConditionEvaluationError(f"cannot compare {_describe(a)} with {_describe(b)}")
                if not _COMPARATORS[type(comparison)](a, b):
                    return False
                a = b
            return True
        case ast.Call(func=ast.Name(id=name), args=args):
            return _call(name, [_evaluate(arg, result) for arg in args])
    raise ConditionEvaluationError(f"unsupported expression {type(node).__name__}")  # pragma: no cover


def _comparable(a: object, b: object, op: ast.cmpop) -> bool:
    if isinstance(a, str) and isinstance(b, str):
        return isinstance(op, ast.Eq | ast.NotEq)
    return all(isinstance(v, int | float) for v in (a, b))


def _index(container: object, index: object) -> object:
    if isinstance(container, Mapping):
        if index not in container:
            raise ConditionEvaluationError(f"result has no key {index!r} (keys: {sorted(map(str, container))})")
        return container[index]
    if isinstance(container, Sequence) and not isinstance(container, str):
        if not isinstance(index, int):
            raise ConditionEvaluationError(f"a list is indexed by a number, not {index!r}")
        if not -len(container) <= index < len(container):
            raise ConditionEvaluationError(f"index {index} is out of range for a result of length {len(container)}")
        return container[index]
    raise ConditionEvaluationError(f"cannot index {_describe(container)}")


def _call(name: str, args: list[Any]) -> object:
    if name == "len":
        if len(args) != 1 or not isinstance(args[0], Sequence | Mapping) or isinstance(args[0], str):
            raise ConditionEvaluationError(f"len() takes one list or mapping, got {[_describe(a) for a in args]}")
        return len(args[0])
    if name == "isnan":
        if len(args) != 1:
            raise ConditionEvaluationError("isnan() takes one number")
        return math.isnan(_number(args[0], "isnan()"))
    values = args[0] if len(args) == 1 and isinstance(args[0], Sequence) and not isinstance(args[0], str) else args
    numbers = [_number(value, f"{name}()") for value in values]
    if name == "abs":
        if len(args) != 1:
            raise ConditionEvaluationError("abs() takes one number")
        return abs(_number(args[0], "abs()"))
    if not numbers:
        raise ConditionEvaluationError(f"{name}() of an empty result")
    return min(numbers) if name == "min" else max(numbers)
