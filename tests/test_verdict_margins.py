"""results.md's region bounds (analysis.verdict_table): printed at the precision of the figures beside
them, whatever the float a margin was derived as."""

from __future__ import annotations

import math

import pytest

from qkvlab.analysis.verdict_table import fails_text, holds_text
from qkvlab.analysis.verdicts import Region


@pytest.mark.parametrize(
    "holds,unit,text",
    [
        ((-0.862496, math.inf), "%", "above -0.86%"),  # half of a paper's -1.72992%: was "above -0.862496%"
        ((-0.596421, math.inf), "%", "above -0.60%"),
        ((-math.inf, 2.0), "%", "below +2%"),  # a hand-set margin keeps its short form
        ((-1.19, 1.19), "%", "within ±1.19%"),
        ((-0.45, math.inf), "pts", "above -0.45 pts"),
        ((-10.2, math.inf), "pts", "above -10.2 pts"),
        ((-3.3549999, math.inf), "pts", "above -3.35 pts"),
        ((-math.inf, 0.0), "%", "below 0"),
        ((-math.inf, 0.004), "%", "below 0"),  # rounds to nothing at two decimals
        ((0.93312345, math.inf), "", "above 0.9331"),
        ((0.99, math.inf), "", "above 0.99"),
        ((0.995, math.inf), "", "above 0.995"),
    ],
)
def test_a_bound_is_printed_at_the_precision_of_the_figures_beside_it(holds, unit, text):
    region = Region(holds=holds, fails=[("below", holds[0])] if holds[1] == math.inf else [("above", holds[1])])
    assert holds_text(region, unit) == text


def test_the_failing_side_is_rounded_alike():
    region = Region(holds=(-0.862496, math.inf), fails=[("below", -1.7299)])
    assert fails_text(region, "%") == "below -1.73%"
    both = Region(holds=(-1.19, 1.19), fails=[("below", -2.384567), ("above", 2.384567)])
    assert fails_text(both, "%") == "beyond ±2.38%"
