"""The read-ahead set (``dlcachefs.cache.buffers.ReadAhead``): spare files (guesses whose
bytes are in the cache too) are let go, oldest first, when room is asked for or a file is
put (only when that makes the room: a file that would not fit anyway lets none go), and
once old; nothing else ever is, and the byte counts always match what is held."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dlcachefs.cache.buffers import ReadAhead
from dlcachefs.cache.source import Identity

OPS = st.lists(st.one_of(
    st.tuples(st.just("put"), st.integers(0, 15), st.integers(1, 40), st.booleans()),
    st.tuples(st.just("take"), st.integers(0, 15), st.just(0), st.just(False)),
    st.tuples(st.just("room"), st.just(0), st.integers(0, 120), st.just(False)),
    st.tuples(st.just("drop"), st.just(0), st.just(0), st.just(False)),
    st.tuples(st.just("old"), st.just(0), st.just(0), st.just(False)),
), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops=OPS)
def test_spares_go_first_and_oldest_first(ops):
    ra = ReadAhead(100)
    held: dict[int, tuple[int, bool, str]] = {}  # the model: ino -> (size, spare, owner)
    spare_order: list[int] = []

    def make_room(n: int) -> bool:
        """Spares go, oldest first, only when that makes room for ``n``."""
        used = sum(v[0] for v in held.values())
        if sum(v[0] for v in held.values() if not v[1]) + n > 100:
            return False  # not even without every spare: none is let go
        while used + n > 100 and spare_order:
            gone = spare_order.pop(0)
            used -= held.pop(gone)[0]
        return used + n <= 100

    for op, ino, n, spare in ops:
        if op == "put":
            owner = "a" if ino % 2 else "b"
            ra.put(ino, Identity(n, 0, 0), None, b"x" * n, owner, cached=spare, spare=spare)
            if ino in spare_order:
                spare_order.remove(ino)
            held.pop(ino, None)
            make_room(n)
            held[ino] = (n, spare, owner)
            if spare:
                spare_order.append(ino)
        elif op == "take":
            f = ra.take(ino)
            assert (f is None) == (ino not in held)
            if f is not None:
                assert len(f.data) == held.pop(ino)[0]
                if ino in spare_order:
                    spare_order.remove(ino)
        elif op == "room":
            assert ra.has_room(n) == make_room(n)
        elif op == "old":
            ra.drop_old_spares(0.0)  # every spare is older than 0 s
            for i in spare_order:
                del held[i]
            spare_order.clear()
        else:
            ra.drop_owner("a")
            for i in [i for i, v in held.items() if v[2] == "a"]:
                del held[i]
                if i in spare_order:
                    spare_order.remove(i)
        assert ra.bytes == sum(v[0] for v in held.values())
        assert ra.spare_bytes == sum(v[0] for v in held.values() if v[1])
        assert {i for i in held} == {i for i in range(16) if i in ra}


def test_young_spares_stay():
    ra = ReadAhead(100)
    ra.put(1, Identity(10, 0, 0), None, b"x" * 10, "scan", cached=True, spare=True)
    ra.drop_old_spares(3600.0)
    assert 1 in ra and ra.bytes == 10
    ra.drop_old_spares(0.0)
    assert 1 not in ra and ra.bytes == 0
