"""The suite's yardstick: bystanders' outputs on the shared server repeat exactly."""

from __future__ import annotations

from tests.support.bystanders import Bystanders


def test_bystanders_repeat_their_clean_outputs(bystanders: Bystanders) -> None:
    assert all(bystanders.clean), bystanders.clean
    bystanders.assert_unchanged()
