"""tests/mutants.py's list still describes the tree: each mutation's text occurs once in its file and its test
exists (a stale entry after code moves would otherwise report an error only when the mutants are run)."""

from tests import mutants


def test_every_mutation_still_applies_to_the_tree():
    assert mutants.check() == []
    assert len({(m.path, m.old) for m in mutants.MUTANTS}) == len(mutants.MUTANTS)
    assert all(m.old != m.new for m in mutants.MUTANTS)
