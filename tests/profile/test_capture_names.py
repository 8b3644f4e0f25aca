"""A capture's name becomes a directory under model_dir/profile: nothing else is accepted."""

from __future__ import annotations

import pytest

from shardflow.profile.capture import check_capture_name


@pytest.mark.parametrize("name", ["steps-100-103", "on-demand-5-8", "a", "A_1-b", "x" * 100])
def test_plain_names_are_accepted(name):
    assert check_capture_name(name) == name


@pytest.mark.parametrize(
    "name", ["", "../../etc", "a/b", "..", ".hidden", "-starts-with-dash", "x" * 101, "a b", "é", None, 7, ["a"]]
)
def test_names_that_could_leave_the_profile_directory_or_are_not_names_are_refused(name):
    with pytest.raises(ValueError, match="a capture name is 1 to 100 letters"):
        check_capture_name(name)
