"""PeerFetch: what a spare's prefetch asks for, and what its adoption does when the prefetch does not serve.

The snapshot actor is replaced by a recorder of the Fetches handed over (``Handoff.bind``); the answers are
set by the test, as the actor would set them from the peers' replies."""

from __future__ import annotations

from deadpool.actors.handoff import Fetch, Fetched, Handoff
from deadpool.errors import RestoreFailed
from deadpool.protocol.messages import Prepare, RestorePart
from deadpool.protocol.view import View
from deadpool.snapshot.statetree import Manifest
from deadpool.worker.fetch import PeerFetch

A, X, SPARE = "h:rank0:a", "h:rank1:x", "h:spare0:s"


def _view(epoch: int, seats: list[str], spares: list[str], resume: int, restore_from: dict[int, str]) -> View:
    members = [*seats, *spares]
    return View(epoch=epoch, seats=seats, spares=spares, resume_step=resume, store_prefix=f"epoch-{epoch}",
                store_addr="127.0.0.1:1", bulk_addrs={m: f"inproc://{m}" for m in members},
                hosts=dict.fromkeys(members, "h"), buddies=[1, 0], restore_from=restore_from)


def _prefetching() -> tuple[list[Fetch], Handoff, PeerFetch]:
    """A spare the Prepare of epoch 2 chose for seat 1 (lost): what it handed over, its handoff, its fetch."""
    posted: list[Fetch] = []
    handoff = Handoff()
    handoff.bind(lambda fetch: posted.append(fetch))
    fetch = PeerFetch(SPARE, handoff, timeout=5.0)
    fetch.start_prefetch(Prepare(2, [1], "seat 1 lost", {1: SPARE}), 1, _view(1, [A, X], [SPARE], -1, {}))
    return posted, handoff, fetch


def test_a_prefetch_whose_slices_are_refused_is_asked_again_for_the_resume_step() -> None:
    """The newest copy of the dead seat (step 4) is newer than the other seat's slices can serve (a lagging
    copy made the plan resume from step 3): the refusal of the prefetch is not the adoption's failure."""
    posted, handoff, fetch = _prefetching()
    (copy,) = posted
    assert (copy.seat, copy.part, copy.member, copy.newest) == (1, RestorePart.HELD, A, True)
    copy.future.set_result(Fetched(4, Manifest(b"", (), 0), []))  # A holds seat 1's copy of step 4
    (slice_4,) = posted[1:]
    assert (slice_4.seat, slice_4.step, slice_4.part, slice_4.member) == (0, 4, RestorePart.SLICE, A)
    slice_4.future.set_exception(RestoreFailed("seat 0 holds no snapshot of step 4"))

    committed = _view(2, [A, SPARE], [], 3, {1: A})
    assert len(posted) == 2  # nothing more before the commit
    asked_again: list[tuple[int, int, RestorePart]] = []

    def refuse(item: Fetch) -> None:  # the adoption's own fetch, answered at once
        asked_again.append((item.seat, item.step, item.part))
        item.future.set_exception(RestoreFailed(f"refused step {item.step}"))

    handoff.bind(refuse)
    try:
        fetch.from_buddy(committed, 1)()
    except RestoreFailed as err:
        assert "refused step 3" in str(err)
    else:
        raise AssertionError("the refused fetch of step 3 was not reported")
    assert asked_again == [(1, 3, RestorePart.HELD), (0, 3, RestorePart.SLICE)]


def test_a_commit_before_the_copys_answer_asks_for_the_slices_of_its_step_at_once() -> None:
    """The survivors stopped at once and the commit came first: the slices of the resume step are asked for
    beside the copy still in flight (not after it), and the copy's answer asks for nothing more."""
    posted, handoff, fetch = _prefetching()
    (copy,) = posted
    empty = Manifest(b"", (), 0)

    def answer(item: Fetch) -> None:  # the slice is answered, and then the copy, as the peers' replies come in
        posted.append(item)
        item.future.set_result(Fetched(item.step, empty, []))
        copy.future.set_result(Fetched(3, empty, []))

    handoff.bind(answer)
    manifest, _ = fetch.from_buddy(_view(2, [A, SPARE], [], 3, {1: A}), 1)()
    assert manifest == empty
    assert [(f.seat, f.step, f.part, f.member) for f in posted[1:]] == [(0, 3, RestorePart.SLICE, A)], \
        "one slice, of the resume step, asked for once"


def test_a_prefetch_the_view_does_not_use_asks_for_nothing_when_its_copy_answers_late() -> None:
    """A second seat was lost before the commit: the view fetches that seat's slice from its buddy, not what
    the prefetch would ask.  The adoption asks for its own parts; the prefetch's copy, answered after that,
    must not ask for slices of the same step (the snapshot actor would fail the adoption's as asked again)."""
    posted, handoff, fetch = _prefetching()
    (copy,) = posted
    empty = Manifest(b"", (), 0)
    adoption: list[Fetch] = []

    def answer(item: Fetch) -> None:
        adoption.append(item)
        item.future.set_result(Fetched(item.step, empty, []))

    handoff.bind(answer)
    fetch.from_buddy(_view(3, ["h:rank9:b", SPARE], [], 3, {1: A, 0: "h:rank9:c"}), 1)()
    assert [(f.seat, f.step, f.part, f.member) for f in adoption] == [
        (1, 3, RestorePart.HELD, A), (0, 3, RestorePart.SLICE, "h:rank9:c")]
    copy.future.set_result(Fetched(3, empty, []))  # the prefetch's copy answers late
    assert len(adoption) == 2, "the dropped prefetch asked for its slices after all"
