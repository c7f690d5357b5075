"""The default run's share of the test matrices (conftest.static_archs, conftest.thin): what runs by default and
what only under ``-m slow``."""
import pytest

from conftest import DEFAULT_STATIC_ARCHS, static_archs, thin


def _slow(p):
    return any(m.name == "slow" for m in getattr(p, "marks", ()))


def test_static_archs_default_and_own():
    archs = (75, 80, 86, 89, 90)
    params = static_archs(archs)
    assert [a for a in params if not hasattr(a, "marks")] == list(DEFAULT_STATIC_ARCHS) == [80, 90]
    assert [p.values[0] for p in params if _slow(p)] == [75, 86, 89]
    params = static_archs(archs, own=(75,))
    assert [a for a in params if not hasattr(a, "marks")] == [75, 80, 90]
    params = static_archs(archs, default=(80,))
    assert [a for a in params if not hasattr(a, "marks")] == [80]


def test_thin_keeps_every_nth_from_the_first():
    out = thin(["a", "b", "c", "d", "e"])
    assert [c for c in out if isinstance(c, str)] == ["a", "c", "e"]
    assert [(p.values, _slow(p)) for p in out if not isinstance(p, str)] == [(("b",), True), (("d",), True)]
    out = thin(list(range(8)), every=4)
    assert [c for c in out if isinstance(c, int)] == [0, 4]


def test_thin_unpacks_tuples_and_keeps_params():
    out = thin([(1, 2), (3, 4), pytest.param(5, 6, id="five", marks=pytest.mark.gpu)], unpack=True, every=1)
    assert out[:2] == [(1, 2), (3, 4)]
    out = thin([(1, 2), (3, 4), (7, 8), pytest.param(5, 6, id="five", marks=pytest.mark.gpu)], unpack=True)
    assert out[1].values == (3, 4) and _slow(out[1])
    assert out[3].values == (5, 6) and out[3].id == "five"
    assert {m.name for m in out[3].marks} == {"gpu", "slow"}
    # one parameter whose values are tuples: not unpacked
    out = thin([(1, 2), (3, 4)])
    assert out[1].values == ((3, 4),)


@pytest.mark.parametrize("x", thin([0, 1, 2, 3]))
def test_thinned_cases_deselected_by_default(x, request):
    """Under the default ``-m "not slow"`` only the kept cases run (the others carry the mark)."""
    assert x in (0, 2) or request.node.get_closest_marker("slow") is not None
