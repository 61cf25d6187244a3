"""The condition language: what it computes, and everything it refuses to run."""

from __future__ import annotations

import math

import pytest

from controlplane.rollouts.conditions import ConditionError, ConditionEvaluationError, compile_condition

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize(
    ("text", "result", "expected"),
    [
        ("result < 0.01", 0.005, True),
        ("result < 0.01", 0.02, False),
        ("result[0] >= 0.95", [0.97], True),
        ("result[-1] >= 0.95", [0.1, 0.9], False),
        ("len(result) > 0 and result[0] < 1", [0.5], True),
        ("len(result) == 0 or result[0] < 1", [], True),
        ("not result['p99'] > 2.5", {"p99": 1.9}, True),
        ("result['canary'] - result['stable'] <= 0.005", {"canary": 0.012, "stable": 0.01}, True),
        ("result['canary'] / result['stable'] < 1.5", {"canary": 0.03, "stable": 0.01}, False),
        ("0 <= result < 1", 0.5, True),
        ("abs(result - 1) < 0.1", 1.05, True),
        ("max(result) < 3 and min(result) > 1", [2, 2.5], True),
        ("max(result[0], result[1]) <= 2", [1, 3], False),
        ("result % 2 == 1", 7, True),
        ("-result < 0", 3, True),
        ("isnan(result) or result > 1", math.nan, True),
        ("result['status'] == 'ok'", {"status": "ok"}, True),
        ("result['checks']['golden'] == 1", {"checks": {"golden": 1}}, True),
        ("True", 0, True),
    ],
)
def test_conditions_compute_what_they_say(text: str, result: object, expected: bool) -> None:
    assert compile_condition(text).evaluate(result) is expected


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("__import__('os').system('true')", "a call of anything but"),
        ("result.__class__", "attribute access"),
        ("result.real > 0", "attribute access"),
        ("(lambda: 1)() == 1", "a call of anything but"),
        ("(lambda x: x)", "a lambda"),
        ("[x for x in result] == []", "a comprehension"),
        ("sum(x for x in result) > 0", "a call of anything but"),
        ("len([x for x in result]) > 0", "a comprehension"),
        ("{k: 1 for k in result} == {}", "a comprehension"),
        ("result ** 2 > 1", "the operator Pow"),
        ("open('/etc/passwd') == 1", "a call of anything but"),
        ("os > 1", "the name 'os'"),
        ("result[0:2] == 1", "an index that is not a constant"),
        ("result[result] > 1", "an index that is not a constant"),
        ("len(*result) > 1", "this call of len()"),
        ("max(result, key=abs) > 1", "a call of anything but"),
        ("result in [1, 2]", "the comparison In"),
        ("result is None", "the comparison Is"),
        ("result == None", "the constant None"),
        ("(y := 1) == 1", "a NamedExpr"),
        ("f'{result}' == 'x'", "a JoinedStr"),
        ("result & 1 == 1", "the operator BitAnd"),
        ("result[0]", "is a value, not a condition"),
        ("result > 1 and result", "'and'/'or' over a value"),
        ("not result", "'not' of a value"),
        ("result > 0.9 && result < 1", "write 'and' instead"),
        ("result == 1 || result == 2", "write 'or' instead"),
        ("result <", "not a valid expression"),
        ("import os", "not a valid expression"),
        ("", "non-empty"),
        ("result > 1 " + "+ 1 " * 300, "characters; the limit"),
        ("result > " + " + ".join(["1"] * 120), "syntax nodes; the limit"),
    ],
)
def test_conditions_outside_the_language_are_refused_with_a_reason(text: str, complaint: str) -> None:
    with pytest.raises(ConditionError) as caught:
        compile_condition(text, where="steps[1].analysis.metrics[0].successCondition")
    assert complaint in caught.value.message
    assert caught.value.message.startswith("steps[1].analysis.metrics[0].successCondition: ")


@pytest.mark.parametrize(
    ("text", "result", "complaint"),
    [
        ("result[0] > 1", [], "out of range"),
        ("result['p99'] > 1", {"p50": 1}, "no key 'p99'"),
        ("result > 1", "lots", "cannot compare"),
        ("result * 10 > 1", "x", "needs a number"),
        ("result * 1000000 > 1", [1], "needs a number"),  # lists never multiply
        ("result / 0 > 1", 5, "division by zero"),
        ("len(result) > 1", 5, r"len\(\) takes one list"),
        ("result['a'] > 1", [1], "indexed by a number"),
        ("result[0] > 1", 3, "cannot index"),
        ("result > 'a'", "b", "cannot compare"),
        ("max(result) > 1", [], "empty result"),
    ],
)
def test_evaluation_errors_are_errors_not_answers(text: str, result: object, complaint: str) -> None:
    condition = compile_condition(text)
    with pytest.raises(ConditionEvaluationError, match=complaint):
        condition.evaluate(result)


def test_compiled_conditions_never_reach_eval(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    def forbidden(*_: object, **__: object) -> None:
        raise AssertionError("eval/exec/compile must never run for a condition")

    condition = compile_condition("len(result) > 0 and result[0] < 0.01")
    for name in ("eval", "exec", "compile"):
        monkeypatch.setattr(builtins, name, forbidden)
    assert condition.evaluate([0.001]) is True
