"""Philox4x32-10 and the dropout mask built from it (docs/extensions.md, "Dropout's random bits").

Known answers are Random123's (kat_vectors, philox4x32_10); the mask layout, threshold and
statistics follow the specification so that the reference reproduces any backend's mask.
"""
import numpy as np
import pytest

from flasharray import reference
from flasharray._private import philox

KAT = [  # (counter, key, expected output), Random123 kat_vectors
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", KAT, ids=["zeros", "ones", "pi"])
def test_known_answers(counter, key, expected):
    words = philox.philox4x32(counter, key)
    assert tuple(int(w) for w in words) == expected


def test_known_answers_vectorised():
    """Many counters at once give what each gives alone (no cross-talk between lanes)."""
    counters = np.array([c for c, _, _ in KAT[:1]] * 3 + [(5, 6, 7, 8)], dtype=np.uint32).T
    words = np.stack(philox.philox4x32(tuple(counters), (0, 0)))
    assert [int(w) for w in words[:, 0]] == list(KAT[0][2])
    alone = philox.philox4x32((5, 6, 7, 8), (0, 0))
    assert [int(w) for w in words[:, 3]] == [int(w) for w in alone]


def test_rounds_matter():
    assert philox.philox4x32((0, 0, 0, 0), (0, 0), rounds=7) != philox.philox4x32((0, 0, 0, 0), (0, 0))


@pytest.mark.parametrize("p,expected", [(0.0, 0), (0.5, 32768), (0.1, 6554), (0.99999, 65535), (0.25, 16384)])
def test_threshold(p, expected):
    assert philox.threshold(p) == expected


def test_uniform16_layout():
    """Column j takes bits 16·(j & 1) of word (j & 7) >> 1 of the block of columns 8·(j >> 3)."""
    seed, offset, bh, i = 0x1234_5678_9ABC_DEF0, 77, 5, 3
    cols = np.arange(24)
    got = philox.uniform16(seed, offset, bh, i, cols)
    for j in cols:
        words = philox.philox4x32((j >> 3, i, bh, offset), (seed & 0xFFFFFFFF, seed >> 32))
        w = int(words[(j & 7) >> 1])
        assert int(got[j]) == (w >> (16 * (j & 1))) & 0xFFFF, j
    assert got.dtype == np.uint16


def test_keep_mask_is_uniform16_above_threshold():
    p, seed, offset = 0.3, 42, 9
    mask = philox.keep_mask(p, seed, offset, (2, 3), 5, 19)
    bh = np.arange(6).reshape(2, 3, 1, 1)
    values = philox.uniform16(seed, offset, bh, np.arange(5)[:, None], np.arange(19)[None, :])
    np.testing.assert_array_equal(mask, values >= philox.threshold(p))
    assert mask.shape == (2, 3, 5, 19) and mask.dtype == bool


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_within_statistical_bounds(p):
    mask = philox.keep_mask(p, 2024, 0, (4, 2), 256, 257)
    keep = 1.0 - philox.threshold(p) / 65536.0
    n = mask.size
    sigma = np.sqrt(keep * (1 - keep) / n)
    assert abs(mask.mean() - keep) < 5 * sigma, (mask.mean(), keep, sigma)
    # rows and columns are not correlated with the drop decision (each row's rate near keep too)
    rows = mask.reshape(-1, 257).mean(axis=1)
    assert abs(rows.mean() - keep) < 5 * sigma and rows.std() < 5 * np.sqrt(keep * (1 - keep) / 257)


def test_uniform16_values_are_uniform():
    values = philox.uniform16(7, 0, np.arange(8)[:, None, None], np.arange(64)[:, None], np.arange(128))
    counts = np.bincount((values >> 12).ravel(), minlength=16)   # 16 buckets of the top 4 bits
    expected = values.size / 16
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 50  # 15 degrees of freedom: P(chi2 > 50) < 1e-5


@pytest.mark.parametrize("change", ["seed", "seed_high", "offset", "row", "col_block", "bh"])
def test_every_counter_and_key_word_changes_the_bits(change):
    base = dict(seed=3, offset=0, bh=0, rows=np.arange(8)[:, None], cols=np.arange(64)[None, :])
    other = dict(base)
    if change == "seed":
        other["seed"] = 4
    elif change == "seed_high":
        other["seed"] = 3 + (1 << 32)   # only the second key word differs
    elif change == "offset":
        other["offset"] = 1
    elif change == "row":
        other["rows"] = base["rows"] + 8
    elif change == "col_block":
        other["cols"] = base["cols"] + 64
    else:
        other["bh"] = 1
    a = philox.uniform16(base["seed"], base["offset"], base["bh"], base["rows"], base["cols"])
    b = philox.uniform16(other["seed"], other["offset"], other["bh"], other["rows"], other["cols"])
    assert (a != b).mean() > 0.99   # independent 16-bit values agree with probability 2**-16


def test_columns_within_a_block_differ():
    values = philox.uniform16(1, 0, 0, np.arange(32)[:, None], np.arange(8)[None, :])
    assert all(len(set(row.tolist())) >= 7 for row in values)


@pytest.mark.parametrize("seed,offset,exc,word", [
    (-1, 0, ValueError, "seed"), (2 ** 64, 0, ValueError, "seed"), (1.0, 0, TypeError, "seed"),
    (True, 0, TypeError, "seed"), (0, -1, ValueError, "offset"), (0, 2 ** 32, ValueError, "offset"),
    (0, "1", TypeError, "offset"),
])
def test_check_seed_rejects(seed, offset, exc, word):
    with pytest.raises(exc, match=word):
        philox.check_seed(seed, offset)


def test_check_seed_accepts_numpy_ints_and_extremes():
    assert philox.check_seed(np.uint64(2 ** 64 - 1), np.int32(5)) == (2 ** 64 - 1, 5)
    assert philox.check_seed(0, 2 ** 32 - 1) == (0, 2 ** 32 - 1)


def test_reference_dropout_mask_is_the_philox_mask():
    mask = reference.dropout_mask((2, 3), 17, 33, 0.25, seed=11, offset=4)
    np.testing.assert_array_equal(mask, philox.keep_mask(0.25, 11, 4, (2, 3), 17, 33))
    # entry (b, h) uses the flat index b·3 + h
    np.testing.assert_array_equal(mask[1, 2], philox.keep_mask(0.25, 11, 4, (6,), 17, 33)[5])
    assert reference.dropout_mask((), 4, 4, 0.0, seed=0).all()
