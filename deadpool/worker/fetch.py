"""What a seat being restored asks its peers for: its own snapshot from its buddy, the others' slices.

A seat's snapshot holds its own state and its slice of the replicated region (parameters and
optimizer state that are the same on every seat).  A seat restored from its buddy (the spare) or
restoring in full gets the rest of the region from the other seats: each serves its slice from
its own snapshot, or, for a seat being restored too, its buddy from its copy.  Everything is
asked for at once through the snapshot actor (``Fetch``), and waited for as a whole once the
adoption has built its groups (they form while the answers come in).  A spare
chosen by a Prepare asks before the view that seats it names the step (``start_prefetch``); the
adoption keeps what came if it is of that step.  Why this beats a collective on the new group
is in docs/design/swap.md ("A swap at the speed of one step").
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from deadpool.actors.handoff import Fetch, Fetched, Handoff
from deadpool.errors import ActorStopped, CollectiveAborted, RestoreFailed
from deadpool.protocol.messages import Prepare, RestorePart
from deadpool.protocol.view import View
from deadpool.snapshot.statetree import Manifest, expand, replicated_layout, replicated_slice, scatter

Restored = tuple[Manifest, torch.Tensor]  # a seat's snapshot: its manifest and the arena it describes
Asked = tuple[int, RestorePart, str]  # (seat, part of its snapshot, member asked for it)
Answers = list[concurrent.futures.Future[Fetched]]  # one per part asked for, in order
NO_STEP = -2  # Prefetch.slices_step once the slices will never be asked for


@dataclass
class Prefetch:
    """What a spare asked for when a Prepare chose it, before the view that seats it names the step.

    The other seats' slices are asked for once a step is known, by whichever comes first: the answer with
    the buddy's newest copy (its step), or the commit (the resume step).  Before that only the copy is asked.
    """

    seat: int
    asked: list[Asked]
    answers: Answers
    slices_step: int | None = None  # the step the slices were asked for (None: not yet)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _choose(self, step: int) -> bool:
        """Settle the step the slices are asked for; False if it was settled before (by the other thread)."""
        with self._lock:
            if self.slices_step is not None:
                return False
            self.slices_step = step
            return True

    def ask_slices(self, step: int, post: Callable[[Fetch], None], finishing: bool = False) -> None:
        """Ask for every slice of `step` into this prefetch's answers, unless a step was already chosen.
        Called on the runtime thread (the copy's answer) and on the compute thread (the commit, or a planned
        move's Prepare, which says every seat finishes `step`: `finishing`)."""
        if not self._choose(step):
            return
        for (other, part, member), future in zip(self.asked[1:], self.answers[1:], strict=True):
            try:
                post(Fetch(other, step, member, future, part, finishing=finishing))
            except RuntimeError as err:  # the runtime thread has stopped (shutdown)
                future.set_exception(RestoreFailed(str(err)))

    def fail_slices(self, error: RestoreFailed) -> None:
        """No step will be known from the copy: the slices fail too, unless the commit already asked for them."""
        if not self._choose(NO_STEP):
            return
        for future in self.answers[1:]:
            future.set_exception(error)


class PeerFetch:
    """A worker's restores from its peers (on the compute thread; the snapshot actor does the I/O)."""

    def __init__(self, member: str, handoff: Handoff, timeout: float) -> None:
        self._member = member
        self._handoff = handoff
        self._timeout = timeout  # restore_timeout: every wait for answers is bounded by it
        self.prefetch: Prefetch | None = None  # started by the Prepare that chose this spare
        self.seconds = 0.0  # the last wait for answers

    @staticmethod
    def sources(view: View, seat: int) -> list[Asked]:
        """What restoring `seat` from its buddy asks for in `view`: its copy, then the other seats' slices."""
        return [(seat, RestorePart.HELD, view.restore_from[seat]), *PeerFetch.slice_sources(view, seat)]

    @staticmethod
    def slice_sources(view: View, seat: int) -> list[Asked]:
        """Who serves each other seat's slice: the seat's own member, or the buddy of a seat being restored.
        None after a restore from disk: every seat then completes its state with one all-gather."""
        if view.restores_from_disk(seat) or view.world_size < 2:
            return []
        return [(other, RestorePart.SLICE, view.restore_from.get(other, view.seats[other]))
                for other in range(view.world_size) if other != seat]

    def from_buddy(self, view: View, seat: int) -> Callable[[], Restored]:
        """Ask now for the seat's snapshot from its buddy's copy and the other seats' slices (all at once, or
        already asked for when the Prepare chose this spare); the call returned waits for them and assembles
        the seat's arena, so the caller builds its groups meanwhile.

        The call raises:
            CollectiveAborted: a newer view interrupted the wait.
            RestoreFailed: a part is refused or does not fit; WaitTimeout: not all answered in time.
        """
        asked = self.sources(view, seat)
        prefetch, self.prefetch = self.prefetch, None
        if prefetch is not None and prefetch.asked != asked:  # the view names other sources (another seat lost)
            # A copy answering later asks for nothing: its slices would supersede the ones asked for below.
            prefetch.fail_slices(RestoreFailed("the prefetch was superseded by the view's own fetch"))
            prefetch = None
        if prefetch is None:
            answers = self._ask(view.resume_step, asked)
            return lambda: self.assemble(seat, view.world_size, asked, self._resume_answers(view, asked, answers))
        # The commit came before the copy's answer: the slices of the resume step go out now, beside it.
        prefetch.ask_slices(view.resume_step, self._handoff.post)

        def finish() -> Restored:
            try:
                fetched: list[Fetched] | None = self._resume_answers(view, asked, prefetch.answers)
            except RestoreFailed:
                fetched = None  # a seat holds no slice of the step the newest copy is of: the resume step is older
            if fetched is None or any(part.step != view.resume_step for part in fetched):
                fetched = self._fetch(view, asked)  # the newest copies were not the step every seat can restore
            return self.assemble(seat, view.world_size, asked, fetched)

        return finish

    def snapshot_of(self, view: View, seat: int, step: int) -> Restored:
        """`seat`'s whole snapshot of `step` (its buddy's copy, the other seats' slices), for a spare that re-does the
        seat's next step (an audit); a newer view than `view` interrupts the wait.

        Raises:
            CollectiveAborted: a newer view interrupted the wait.
            RestoreFailed: a part is not held (yet) or does not fit; WaitTimeout: not all answered in time.
        """
        asked = [(seat, RestorePart.HELD, view.buddy_member(seat)), *self._seated_slices(view, seat)]
        fetched = self.wait(view.epoch, f"of seat {seat} at step {step}", asked, self._ask(step, asked))
        return self.assemble(seat, view.world_size, asked, fetched)

    def slices_into(self, view: View, seat: int, manifest: Manifest, arena: torch.Tensor) -> Callable[[], Restored]:
        """Ask now for the other seats' slices of the replicated region that complete a restored arena; the
        call returned waits for them, puts them in place and returns the completed snapshot.

        The call raises:
            CollectiveAborted, RestoreFailed, WaitTimeout: as ``from_buddy``'s.
        """
        asked = self.slice_sources(view, seat) if manifest.replicated else []
        answers = self._ask(view.resume_step, asked)

        def finish() -> Restored:
            if asked:
                self._place(view.resume_step, view.world_size, manifest, arena, asked,
                            self._resume_answers(view, asked, answers))
            return manifest, arena

        return finish

    def start_prefetch(self, prepare: Prepare, seat: int, held: View) -> None:
        """A Prepare chose this spare for `seat`: ask now for the newest copies of what the view that seats it
        will most likely restore (the seat's copy from its buddy, the slices from the seats that keep theirs),
        while the survivors finish their step; ``from_buddy`` keeps them if the step is the one.  The slices
        are asked for once the copy's answer says which step it is of (the seats may hold a newer one), or at
        once for a planned move, whose Prepare names the step the seat left after."""
        known = prepare.left_after if prepare.planned and prepare.left_after >= 0 else None  # a move's resume step
        if self.prefetch is not None and self.prefetch.seat == seat and known in (None, self.prefetch.slices_step):
            return  # asked already (by an earlier Prepare, or by the move's Takeover)
        failed = set(prepare.failed_seats)
        buddy = held.seats[held.buddies[seat]]
        if held.buddies[seat] in failed or buddy == self._member:
            return  # no copy survives there: the commit will say what happens
        slices = [(other, RestorePart.SLICE, held.seats[held.buddies[other]] if other in failed else held.seats[other])
                  for other in range(held.world_size) if other != seat]
        own = (seat, RestorePart.HELD, buddy)
        (copy,) = self._ask(held.resume_step if known is None else known, [own], newest=known is None)
        answers: Answers = [copy, *(concurrent.futures.Future() for _ in slices)]
        for future in answers[1:]:
            future.add_done_callback(lambda _: self._handoff.wake())
        prefetch = Prefetch(seat, [own, *slices], answers)
        self.prefetch = prefetch
        if known is not None:  # every part at once
            prefetch.ask_slices(known, self._handoff.post, finishing=True)
            return

        def ask_slices(_: concurrent.futures.Future[Fetched]) -> None:
            """Runs on the runtime thread, where the copy's answer came in."""
            error = copy.exception()
            if error is None:
                prefetch.ask_slices(copy.result().step, self._handoff.post)
            else:
                prefetch.fail_slices(RestoreFailed(f"the prefetch of seat {seat}'s copy failed: {error}"))

        copy.add_done_callback(ask_slices)

    @staticmethod
    def takeover_sources(held: View, seat: int) -> list[Asked]:
        """What a move's spare asks for when told it takes `seat` of `held`: the seat's snapshot from the member that
        moves away (alive, it answers once it has taken it, and exits only once the answer has left), the other
        seats' slices from their members."""
        return [(seat, RestorePart.HELD, held.seats[seat]), *PeerFetch._seated_slices(held, seat)]

    @staticmethod
    def _seated_slices(view: View, seat: int) -> list[Asked]:
        """Every other seat's slice, from the member in that seat."""
        return [(other, RestorePart.SLICE, view.seats[other]) for other in range(view.world_size) if other != seat]

    def start_takeover(self, seat: int, step: int, held: View) -> Prefetch:
        """A move's Takeover reserved this spare for `seat`, whose member leaves after `step`: ask now for that
        step's snapshot of it (``takeover_sources``), while the seats are still in the step (each part is
        answered once its seat has taken it). The move's Prepare keeps what was asked."""
        asked = self.takeover_sources(held, seat)
        prefetch = Prefetch(seat, asked, self._ask(step, asked, finishing=True), slices_step=step)
        self.prefetch = prefetch
        return prefetch

    def assemble(self, seat: int, world: int, asked: Sequence[Asked], fetched: Sequence[Fetched]) -> Restored:
        """The seat's arena from its own part (first) and the other seats' slices.

        Raises:
            RestoreFailed: the parts do not add up to the seat's snapshot.
        """
        own, *slices = fetched
        try:
            # What the snapshot holds: the seat's own state, then its slice of the replicated region.
            arena = expand(own.manifest, own.frames, seat, world)
        except LookupError as err:  # the frames do not add up to what the manifest says the seat holds
            raise RestoreFailed(f"{err} (from {asked[0][2]})") from err
        self._place(own.step, world, own.manifest, arena, asked[1:], slices)
        return own.manifest, arena

    def wait(self, epoch: int, which: str, asked: Sequence[Asked], answers: Answers) -> list[Fetched]:
        """The answers to what was asked (`which` snapshots, for messages), once all are in; a view newer than
        `epoch` interrupts the wait.

        Raises:
            CollectiveAborted: a newer view interrupted the wait.
            RestoreFailed: an answer is a refusal.
            WaitTimeout: not all answered within the restore timeout.
        """
        what = f"fetching snapshots {which} ({len(asked)} parts)"
        started = time.perf_counter()
        if not self._handoff.wait_until(lambda: all(f.done() for f in answers), epoch, self._timeout, what):
            raise CollectiveAborted("restore", "interrupted by a newer view", interrupted=True)
        fetched = []
        for (seat, part, member), future in zip(asked, answers, strict=True):
            try:
                fetched.append(future.result())
            except (ActorStopped, RestoreFailed) as err:
                raise RestoreFailed(f"fetching seat {seat}'s {part.value} snapshot {which} from {member}: "
                                    f"{err}") from err
        self.seconds = time.perf_counter() - started
        return fetched

    def _fetch(self, view: View, asked: Sequence[Asked]) -> list[Fetched]:
        """Ask for every (seat, part, member) of `asked` at once and wait for all the answers."""
        return self._resume_answers(view, asked, self._ask(view.resume_step, asked))

    def _resume_answers(self, view: View, asked: Sequence[Asked], answers: Answers) -> list[Fetched]:
        """``wait`` for the answers to what was asked of `view`'s resume step."""
        return self.wait(view.epoch, f"of step {view.resume_step}", asked, answers)

    def _ask(self, step: int, asked: Sequence[Asked], newest: bool = False, finishing: bool = False) -> Answers:
        """Hand the snapshot actor a Fetch of step `step` (or the `newest` held) for each part asked for
        (`finishing`: of a step the members asked may still be in)."""
        answers: Answers = []
        for seat, part, member in asked:
            future: concurrent.futures.Future[Fetched] = concurrent.futures.Future()
            future.add_done_callback(lambda _: self._handoff.wake())
            self._handoff.post(Fetch(seat, step, member, future, part, newest, finishing))
            answers.append(future)
        return answers

    @staticmethod
    def _place(step: int, world: int, manifest: Manifest, arena: torch.Tensor, asked: Sequence[Asked],
               slices: Sequence[Fetched]) -> None:
        """Put each fetched slice where its seat's slice lies in `arena`.

        Raises:
            RestoreFailed: a slice was taken under another layout, or has the wrong size.
        """
        target = arena.numpy().data.cast("B")
        for (seat, _, member), fetched in zip(asked, slices, strict=True):
            where = f"seat {seat}'s slice of step {step} (from {member})"
            if replicated_layout(fetched.manifest) != replicated_layout(manifest):
                raise RestoreFailed(f"{where} was taken under another layout of the state")
            first, last = replicated_slice(manifest, seat, world)
            size = sum(len(f) for f in fetched.frames)
            if size != last - first:
                raise RestoreFailed(f"{where}: {size} bytes where it is {last - first}")
            try:
                scatter(fetched.frames, [(first, last)] if last > first else [], target)
            except ValueError as err:
                raise RestoreFailed(f"{where}: {err}") from err
