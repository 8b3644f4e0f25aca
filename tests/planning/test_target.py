"""The --target grammar, and the first evaluation that meets a target."""

import pytest

from shardflow.planning.target import Target, TargetError, first_reached, parse_target

HISTORY = [
    {"global_step": 50, "elapsed_s": 1.0, "metrics": {"loss": 0.9, "accuracy": 0.7}},
    {"global_step": 100, "elapsed_s": 2.0, "metrics": {"loss": 0.4, "accuracy": 0.95}},
    {"global_step": 150, "elapsed_s": 3.0, "metrics": {"loss": 0.2, "accuracy": 0.97}},
]


@pytest.mark.parametrize(
    ("text", "target"),
    [
        ("accuracy>=0.95", Target("accuracy", ">=", 0.95)),
        ("loss <= 0.2", Target("loss", "<=", 0.2)),
        ("top_5/acc>0.5", Target("top_5/acc", ">", 0.5)),
        ("loss<1e-2", Target("loss", "<", 0.01)),
    ],
)
def test_parse_target_reads_metric_comparison_and_value(text, target):
    assert parse_target(text) == target


@pytest.mark.parametrize("text", ["accuracy=0.95", "accuracy>=", ">=0.9", "accuracy => 0.9", "accuracy>=high"])
def test_an_unreadable_target_says_how_to_write_one(text):
    with pytest.raises(TargetError, match=r"accuracy>=0\.95"):
        parse_target(text)


def test_first_reached_is_the_first_evaluation_meeting_the_target():
    reached = first_reached(parse_target("accuracy>=0.95"), HISTORY)
    assert reached is not None
    assert (reached.global_step, reached.elapsed_s) == (100, 2.0)
    assert first_reached(parse_target("loss<0.2"), HISTORY) is None
    inclusive = first_reached(parse_target("loss<=0.2"), HISTORY)
    assert inclusive is not None and inclusive.global_step == 150


def test_a_target_on_a_metric_never_evaluated_names_the_ones_that_were():
    with pytest.raises(TargetError, match=r"evaluates only accuracy, loss"):
        first_reached(parse_target("acc>=0.9"), HISTORY)
