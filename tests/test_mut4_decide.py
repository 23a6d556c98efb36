"""runtime/decide.py (mutation round 4): the decision's text, hand-worked from its documented format (the context,
then one line "name: option / option" per question; the reply one slot per line in question order), and the
question checks that keep that text unambiguous."""

import pytest

from clover_lite.errors import GenerationError
from clover_lite.runtime.decide import decision_messages, decision_reply, question_list


def test_the_user_message_and_reply_template_follow_the_documented_format():
    """Context (trailing whitespace trimmed), then each question's line with its options joined by ' / ', in the
    order given (dict or pairs); the reply has slots q0, q1, ... one per line in that order."""
    q = {"colour": ["red", "dark blue"], "size": ["s", "m", "l"]}
    user, reply = decision_messages("Which window fits?\n\n", q)
    assert user == "Which window fits?\ncolour: red / dark blue\nsize: s / m / l"
    assert reply == "{q0}\n{q1}"
    pairs = [("size", ("s", "m")), ("colour", ["red"])]
    assert decision_messages("x", pairs) == ("x\nsize: s / m\ncolour: red", "{q0}\n{q1}")


def test_an_empty_context_adds_no_blank_line():
    """A context of only whitespace: the user message is the question lines alone."""
    assert decision_messages("  \n", {"a": ["x", "y"]})[0] == "a: x / y"
    assert decision_messages("", [("a", ["x"]), ("b", ["y"])])[0] == "a: x\nb: y"


def test_the_reply_lists_answers_in_question_order_not_by_name():
    """decision_reply puts each question's answer on its own line in the questions' order, whatever the order of
    the answers mapping."""
    q = [("zeta", ["1", "2"]), ("alpha", ["yes", "no"]), ("mid", ["p", "q"])]
    assert decision_reply(q, {"alpha": "no", "mid": "p", "zeta": "2"}) == "2\nno\np"


@pytest.mark.parametrize("questions, words", [
    ({"a:b": ["x"]}, "without ':'"),
    ({"two\nlines": ["x"]}, "one-line"),
    ({" ": ["x"]}, "non-empty"),
    ([("a", ["x"]), ("a", ["y"])], "more than once"),
    ({"a": ["x", "y\nz"]}, "not a one-line string"),
    ({"a": "xy"}, "list of strings"),
    ([("a", ["x"], "extra")], "list of \\(name, options\\) pairs"),
    ("a: x", "give a dict"),
    ({}, "no questions"),
])
def test_questions_that_would_make_the_text_ambiguous_are_refused(questions, words):
    """A name with ':' or a newline (it would read as another question line), a repeated name, an option over two
    lines, options given as one string (not a list of letters), malformed pairs: one GenerationError each."""
    with pytest.raises(GenerationError, match=words):
        question_list(questions)
