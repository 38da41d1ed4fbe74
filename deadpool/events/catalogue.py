"""The catalogue of events: every name a DeadPool process writes to the events file, one place.

Each name is the tag of one typed record in ``events.schema``, which holds its fields; writers
build that record and readers match on its type.  A ``StrEnum`` equals its string, so the
``event`` field on disk is the plain name.  Append new names; never rename one (operators'
scripts and plots read them).
"""

from __future__ import annotations

import enum


class Event(enum.StrEnum):
    """One kind of line in the events file; the comment says what it records (its fields: ``events.schema``)."""

    COORDINATOR_STARTED = "coordinator_started"  # address, store_port
    MEMBER_JOINED = "member_joined"  # role, host
    MEMBER_FAILED = "member_failed"  # member, rank: the dead member; detected_by (vocabulary.Detector), reason
    SPARE_LOST = "spare_lost"  # a spare died or was fenced before it was seated
    SPARE_RELEASED = "spare_released"  # a spare told to leave at the end of the job
    # Planned moves. move_requested: the coordinator accepted a move (rank, member, spare, host of a drain, trigger,
    # reason); seat_left: the member stopped after `step` with its snapshot confirmed and hands its seat over;
    # moved_exit: the member's own last line before it exits 0; seat_held: another seat waits at the end of `step`,
    # the one the member leaves after (late: it had ended that step when told, and pauses inside the next instead).
    MOVE_REQUESTED = "move_requested"
    # score (compute time over the job's median), threshold, steps (slow for this many), moved, reason: a seat that
    # stayed slow, reported once per member (and moved to a spare when --replace-slow's cost model says it pays)
    SEAT_SLOW = "seat_slow"
    SEAT_LEFT = "seat_left"
    SEAT_HELD = "seat_held"
    # Silent data corruption. sdc_suspected: replicas disagreed at `step` (detector, seats, checksums, what);
    # sdc_confirmed: `rank` (member) is the one found corrupt (detector, what, rollback_step it resumes from).
    SDC_SUSPECTED = "sdc_suspected"
    SDC_CONFIRMED = "sdc_confirmed"
    MOVED_EXIT = "moved_exit"
    VIEW_PREPARED = "view_prepared"  # reason, trigger, seats being refilled, told (through_agents of them)
    VIEW_COMMITTED = "view_committed"  # resume_step, reason, seats refilled
    VIEW_ADOPTED = "view_adopted"  # a worker took a committed view
    PAUSED = "paused"  # stopped at a step boundary for a Prepare: reason, backward_abandoned, forward_abandoned
    # source (local | buddy | disk), bytes, live_bytes (of those, already held by live tensors: not reloaded), s,
    # fetch_s, group_s; with a mesh: groups_rebuilt, groups_kept, mesh_group_s
    RESTORED = "restored"
    # rank, old_member, new_member, recovery_s; groups_rebuilt and group_s: the new member's adoption
    SWAP_COMPLETED = "swap_completed"
    ADOPT_FAILED = "adopt_failed"  # a spare could not take its seat (why)
    # command, command_epoch, waited_s, stack: the training thread left a coordinator's command untaken for the
    # collective timeout (it is in the script's own code or a library's: a stuck data loader, say)
    COMPUTE_LATE = "compute_late"
    DISK_FALLBACK = "disk_fallback"  # every seat rolls back to a disk checkpoint
    COLLECTIVE_FAILED = "collective_failed"  # a worker's collective raised or was interrupted
    COLLECTIVE_ERROR_REPORTED = "collective_error_reported"  # the coordinator heard of it
    CHAOS_INJECTED = "chaos_injected"  # action, via, target_member
    FENCED = "fenced"  # a member declared dead, never readmitted
    FENCED_EXIT = "fenced_exit"  # a fenced member woke up and exits, touching nothing
    REJECTED = "rejected"  # reason: a message dropped (bad MAC, stale epoch, rate limit, ...)
    REJOIN_ASKED = "rejoin_asked"  # a restarted coordinator asks a member to re-join
    SNAPSHOT_MEMORY = "snapshot_memory"  # bytes of own snapshots and buddy copies
    SNAPSHOT_SHM_REFUSED = "snapshot_shm_refused"  # the buddy would not map the slot file; TCP instead
    STEP_FINISHED = "step_finished"  # loss, tokens and the user's rt.report fields
    SEAT_FINISHED = "seat_finished"  # a seat reached the last step
    # step, state_digest; untracked_rollback (only when a restore left an untracked data loader where it was, so the
    # final state may differ from a failure-free run's): {loader, where, view, rank}
    TRAINING_FINISHED = "training_finished"
    JOB_FAILED = "job_failed"  # reason, what to do next (reason user_error: detail, exception, step, traceback)
    USER_EXCEPTION = "user_exception"  # the coordinator heard a script's exception: exception, step, verdict
    # loader (its type), where (the script's line that iterates it, "" unknown): a data loader no snapshot holds is
    # iterated (once per process)
    DATA_LOADER_UNTRACKED = "data_loader_untracked"
    # Coordinator failover (terms).
    STANDBY_STARTED = "standby_started"  # a standby coordinator runs: address, store, active, term
    STANDBY_JOINED = "standby_joined"  # the active coordinator heard its standby: standby, term
    STANDBY_LOST = "standby_lost"  # the active coordinator stopped hearing its standby: standby, silent_s
    TAKEOVER = "takeover"  # a standby became the active coordinator: term, old_active, silent_s, confirmed_by
    TAKEOVER_DECLINED = "takeover_declined"  # the active is silent but too few hosts confirm it: reason (once)
    COORDINATOR_STOOD_DOWN = "coordinator_stood_down"  # an older term's coordinator stops acting: term, why
    COMMIT_WITHHELD = "commit_withheld"  # a view not committed: too few hosts heard (heard, hosts)
    TERM_FOLLOWED = "term_followed"  # a member or agent follows a newer term: term, active
    # Chaos specs that will not, or did not, fire.
    # spec, at, seen: a member armed with a --chaos spec passed no `at` point in its first finished step (`step`), so
    # the spec, due at a later step, will likely never fire; seen lists the points it did pass (a warning)
    CHAOS_POINT_UNSEEN = "chaos_point_unseen"
    # spec, at, target_member, target_rank (-1: a spare), last_step (the member's last finished step, -1: none),
    # seen (points it passed in its first step), ended (how the member's run ended), why: written by a launcher at
    # the end for a spec of its host's workers that never fired (the launch then exits with status 4)
    CHAOS_NOT_FIRED = "chaos_not_fired"
    # groups (the store prefixes of the communicators), reason, s (the batch's seconds), late and failed (those that
    # did not return within the bound, or raised): a worker aborted communicators together (NCCL, the stand-in)
    GROUPS_ABORTED = "groups_aborted"
