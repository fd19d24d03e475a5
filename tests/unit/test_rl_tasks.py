import random

import pytest

from rl_loop.tasks import get_task


def test_charclass_reward_is_the_fraction_in_class():
    task = get_task("charclass")
    digits, letters = (next(p for p in task.prompts(random.Random(s), 20) if p.meta["class"] == c) for s, c in
                       ((0, "digits"), (0, "letters")))
    assert task.reward(digits, "12 3a") == pytest.approx(3 / 4)
    assert task.reward(letters, "12 3a") == pytest.approx(1 / 4)
    assert task.reward(letters, "   ") == 0.0
    assert {p.meta["class"] for p in task.prompts(random.Random(1), 50)} == {"digits", "letters"}


def test_unknown_task_lists_the_builtin_ones():
    with pytest.raises(ValueError, match="charclass"):
        get_task("nope")
