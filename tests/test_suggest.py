"""did_you_mean: the closest valid name, appended to an error sentence, or nothing; listed: a list cut short."""

from __future__ import annotations

import pytest

from distamp.suggest import did_you_mean, listed


def test_closest_name():
    assert did_you_mean("init_loss_scale", ["init_loss_scaling", "incr_ratio"]) == " Did you mean 'init_loss_scaling'?"


def test_no_close_name():
    assert did_you_mean("zzz", ["init_loss_scaling"]) == ""
    assert did_you_mean("x", []) == ""


def test_case_differences_still_find_the_key():
    hint = did_you_mean("INIT_LOSS_SCALING", ["init_loss_scaling", "decr_ratio"])
    assert hint == " Did you mean 'init_loss_scaling'?"


@pytest.mark.parametrize("word", [None, b"init_loss_scaling", 3])
def test_non_string_words_get_no_suggestion(word):
    assert did_you_mean(word, ["init_loss_scaling"]) == ""


def test_non_string_choices_are_ignored_and_ties_are_deterministic():
    assert did_you_mean("ab", [None, 1, b"ab", "abc"]) == " Did you mean 'abc'?"
    assert did_you_mean("abc", iter(["abd", "abe"])) == did_you_mean("abc", ["abe", "abd"])


def test_listed_cuts_a_long_list_short_and_counts_the_rest():
    assert listed([], 3) == ""
    assert listed(["a", "b", "c"], 3) == "a, b, c"
    assert listed(["a", "b", "c", "d", "e"], 3) == "a, b, c and 2 more"
