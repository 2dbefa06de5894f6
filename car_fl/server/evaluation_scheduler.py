"""When the server evaluates a round: at once, or in a thread while the next round trains.

With ``background`` a round's evaluation and its recording (row, log line, files, checkpoints)
run in one worker thread; the next round's call (or the run's end) waits for them
(:meth:`EvaluationScheduler.flush`) before it touches the recorder, and an error in either is
raised there. Written here because Flower's ``evaluate_fn`` runs in the round's own thread.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from flwr.app import ArrayRecord

from car_fl.server.round_stats import RoundStats


@dataclass
class Evaluation:
    """One global state waiting to be evaluated and recorded."""

    round: int  # the run's round (after a resume's offset); 0: the initial state
    arrays: ArrayRecord
    stats: RoundStats | None  # None for round 0
    #: The round's wall seconds when its evaluation does not count (background), else None.
    seconds: float | None = None
    future: Future[None] | None = None


@dataclass
class EvaluationScheduler:
    """Runs each round's evaluation and recording, now or in the background."""

    #: Evaluate round r in a thread while round r + 1 trains.
    background: bool = False
    #: The evaluation running in the background, recorded at the next call or at the end.
    running: Evaluation | None = None
    executor: ThreadPoolExecutor | None = field(default=None, repr=False)

    def run(self, job: Evaluation, work: Callable[[], None]) -> None:
        """``work`` (evaluate ``job`` and record it) now, or in the thread with ``background``."""
        if not self.background:
            work()
            return
        if self.executor is None:
            self.executor = ThreadPoolExecutor(1, thread_name_prefix="car-fl-evaluation")
        job.future = self.executor.submit(work)
        self.running = job

    def flush(self) -> None:
        """Wait for the evaluation running in the background, and its recording, if any (an
        error in either is raised here)."""
        job, self.running = self.running, None
        if job is not None:
            assert job.future is not None
            job.future.result()

    def close(self) -> None:
        """Wait for what is running, then end the thread."""
        self.flush()
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None
