"""Where a hit's time to first token goes (``kvtier.scheduler.hit_times``), on a clock the test sets."""

import pytest

from kvtier.common.plans import JobReport
from kvtier.scheduler.hit_times import PHASES, HitTimes


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def times(clock):
    wall = Clock()
    wall.now = 1000.0
    t = HitTimes(clock=clock, wall=lambda: wall.now + (clock.now - 100.0))
    return t


def follow(times, clock, req="r", job=1, rounds=1, read=0.030, ranks=((0.002, 0.005),)):
    """One request through every stage; returns the seconds each phase was given."""
    times.asked(req, arrival_wall=1000.0 - 0.050)  # arrived 50 ms before kvtier was asked
    for _ in range(rounds):
        clock.now += 0.004
        times.asked(req, arrival_wall=1000.0 - 0.050)
    clock.now += 0.001
    times.answered(req, loads=True)
    clock.now += 0.002
    times.sent(req, job)
    sent = clock.now
    for began_after, copy_s in ranks:  # each rank began, read and copied on its own
        began = sent + 0.003 + began_after
        times.reported([JobReport(job, True, True, began_at=began, filled_at=began + read,
                                  finished_at=began + read + copy_s)])
    clock.now = max(sent + 0.003 + b + read + c for b, c in ranks) + 0.006
    times.completed([job])
    clock.now += 0.010
    times.scheduled(req)
    clock.now += 0.020
    times.first_token(req)


def test_each_phase_gets_the_time_between_its_marks(times, clock):
    follow(times, clock, rounds=2)
    got = times.seconds
    assert got["queue"] == pytest.approx(0.050)
    assert got["lookup"] == pytest.approx(0.009)  # two "ask again" rounds of 4 ms, then 1 ms
    assert got["plan"] == pytest.approx(0.002)
    assert got["to_worker"] == pytest.approx(0.005)
    assert got["read"] == pytest.approx(0.030)
    assert got["copy"] == pytest.approx(0.005)
    assert got["report"] == pytest.approx(0.006)
    assert got["resume"] == pytest.approx(0.010)
    assert got["forward"] == pytest.approx(0.020)
    assert times.num_requests == 1 and times.num_rounds == 2
    assert times.num_followed == 0


def test_several_ranks_count_from_the_first_to_begin_to_the_last_to_finish(times, clock):
    follow(times, clock, ranks=((0.0, 0.005), (0.004, 0.001)))
    assert times.seconds["to_worker"] == pytest.approx(0.003)
    # read: from the first rank's start to the slower rank's last read; copy: to the last copy
    assert times.seconds["read"] + times.seconds["copy"] == pytest.approx(0.004 + 0.030 + 0.001)


def test_a_host_hit_reads_nothing(times, clock):
    follow(times, clock, read=0.0)
    assert times.seconds["read"] == 0 and times.seconds["copy"] == pytest.approx(0.005)


def test_requests_that_load_nothing_abort_or_lose_their_load_count_nothing(times, clock):
    times.asked("miss", 999.0)
    times.answered("miss", loads=False)
    times.asked("aborted", 999.0)
    times.answered("aborted", loads=True)
    times.sent("aborted", 7)
    times.forget("aborted")  # it ended before its load reported
    times.reported([JobReport(7, True, True, began_at=1.0, filled_at=2.0, finished_at=3.0)])
    times.completed([7])
    times.asked("no-token", 999.0)
    times.answered("no-token", loads=True)
    times.sent("no-token", 8)
    times.first_token("no-token")  # its load is still in flight: no account
    assert times.num_requests == 0 and all(v == 0 for v in times.seconds.values())
    assert times.num_followed == 0


def test_a_request_asked_again_after_its_load_was_sent_starts_a_new_timeline(times, clock):
    times.asked("r", 999.0)
    times.answered("r", loads=True)
    times.sent("r", 1)
    clock.now += 5.0
    times.asked("r", 999.0)  # preempted and looked up afresh: the first load's times are not its
    assert times.num_followed == 1
    times.answered("r", loads=True)
    times.sent("r", 2)
    times.completed([1])  # the old job's report changes nothing now
    times.completed([2])
    times.scheduled("r")
    times.first_tokens(lambda req_id: req_id == "r")
    assert times.num_requests == 1 and sum(times.seconds[p] for p in PHASES[1:]) < 5.0


def test_a_marks_out_of_order_never_give_a_phase_negative_time(times, clock):
    times.asked("r", 2000.0)  # a wall clock set back after arrival
    times.answered("r", loads=True)
    times.sent("r", 1)
    # worker marks before the scheduler's (a layer-wise load)
    times.reported([JobReport(1, True, True, began_at=50.0, filled_at=40.0, finished_at=30.0)])
    times.completed([1])
    times.first_token("r")
    assert times.num_requests == 1 and all(v >= 0 for v in times.seconds.values())


def test_a_hit_copied_within_its_step_waits_for_no_report_and_no_resumption(times, clock):
    times.asked("r", arrival_wall=1000.0)
    clock.now += 0.001
    times.answered("r", loads=True)
    clock.now += 0.002
    times.sent("r", 1, in_step=True)
    times.scheduled("r")  # the same step schedules the rest of its prompt
    sent = clock.now
    times.reported([JobReport(1, True, True, began_at=sent + 0.003, filled_at=sent + 0.003,
                              finished_at=sent + 0.004)])
    clock.now = sent + 0.020  # the step's forward ends, and its output carries the report and the token
    times.completed([1])
    times.first_tokens(lambda req_id: True)
    got = times.seconds
    assert times.num_requests == 1
    assert got["to_worker"] == pytest.approx(0.003) and got["copy"] == pytest.approx(0.001)
    assert got["read"] == 0 and got["report"] == 0 and got["resume"] == 0
    assert got["forward"] == pytest.approx(0.016)  # from the copy's end: the forward ran right after it
    assert times.num_in_step == 1 and times.in_step_seconds == got
    follow(times, clock, req="s", job=2)  # a hit loaded beside the steps is not counted among them
    assert times.num_requests == 2 and times.num_in_step == 1 and times.in_step_seconds["forward"] == pytest.approx(0.016)
    assert times.num_followed == 0


def test_a_hit_copied_within_its_step_that_ends_there_counts_once_its_report_is_told(times, clock):
    """One output token: vLLM ends the request in the step of its in-step copy, before it tells the
    step's output with the copy's report; the hit counts then, and nothing stays followed."""
    times.asked("r", arrival_wall=1000.0)
    times.answered("r", loads=True)
    times.sent("r", 1, in_step=True)
    times.scheduled("r")
    sent = clock.now
    clock.now = sent + 0.020
    times.finished("r", has_token=True)
    assert times.num_requests == 0 and times.num_followed == 2  # its timeline, and its job
    times.reported([JobReport(1, True, True, began_at=sent + 0.003, filled_at=sent + 0.003,
                              finished_at=sent + 0.004)])
    times.completed([1])
    assert times.num_requests == 1 == times.num_in_step and times.num_followed == 0
    assert times.seconds["copy"] == pytest.approx(0.001) and times.seconds["forward"] == pytest.approx(0.016)
    assert times.seconds["report"] == times.seconds["resume"] == 0
    times.asked("s", arrival_wall=1000.0)  # one that ends with no token, its copy in flight: no account
    times.answered("s", loads=True)
    times.sent("s", 2, in_step=True)
    times.finished("s", has_token=False)
    times.completed([2])
    assert times.num_requests == 1 and times.num_followed == 0
