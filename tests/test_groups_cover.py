"""``kvd.core.leases.groups_cover``: the one rule a claim, a followed hold
and a renewal use to decide that a lease holds a reader's blocks. Short
groups are compared in Python, long ones in numpy; both must give numpy's
``isin`` answer."""

import random

import numpy as np
import pytest

from kvd.core.leases import SMALL_GROUP_IDS, LeaseTable, groups_cover


def _reference(groups, held) -> bool:
    if len(groups) > len(held):
        return False
    return all(np.isin(np.asarray(g, dtype=np.int64), h).all() for g, h in zip(groups, held))


@pytest.mark.parametrize("size", [0, 1, 16, SMALL_GROUP_IDS, SMALL_GROUP_IDS + 1, 1000])
def test_matches_numpy_isin(size):
    rng = random.Random(size)
    for _ in range(300):
        held = [np.array(rng.sample(range(4 * size + 8), size), dtype=np.int32) for _ in range(rng.randint(1, 3))]
        groups = []
        for h in held[:rng.randint(0, len(held) + 1)]:
            ids = h.tolist()
            pick = rng.choice(("whole", "subset", "foreign", "empty"))
            if pick == "subset" and ids:
                ids = sorted(rng.sample(ids, rng.randint(1, len(ids))))
            elif pick == "foreign":
                ids = ids[: rng.randint(0, len(ids))] + [4 * size + 8 + rng.randint(0, 5)]
            elif pick == "empty":
                ids = []
            groups.append(ids)
        assert groups_cover(groups, held) == _reference(groups, held), (groups, held)


def test_more_groups_than_held_and_foreign_ids():
    held = [np.array([1, 2, 3], dtype=np.int32)]
    assert groups_cover([[1, 2, 3]], held)
    assert groups_cover([[3, 1]], held)
    assert not groups_cover([[1], [2]], held)  # a second group the lease does not have
    assert not groups_cover([[1, 4]], held)
    assert not groups_cover([[1, 2**70]], held)  # an id past int64 is simply not held


def test_lease_table_covers_uses_it():
    t = LeaseTable()
    assert t.hold("r1", [[5, 6, 7, 8]], deadline=1e12, now=0.0) == "held"
    assert t.covers("r1", [[5, 6, 7, 8]])
    assert t.covers("r1", [[7, 8]])
    assert not t.covers("r1", [[8, 9]])
    assert not t.covers("r2", [[5]])
