"""propose's wrong result, said in words (#52: "expected a list of 1 trees")."""

from specdec.engine.drafting.calls import check_trees


def test_the_message_counts_trees_in_english():
    assert check_trees([object()], 1) is None
    assert check_trees([], 1) == "returned a list of 0 trees, expected one tree (one per request)"
    assert check_trees([1, 2], 1) == ("returned a list of 2 trees, expected one tree (one per "
                                      "request)")
    assert check_trees([1], 3) == "returned a list of 1 tree, expected 3 trees (one per request)"
    assert check_trees(None, 2) == "returned NoneType, not a list, expected 2 trees (one per request)"
