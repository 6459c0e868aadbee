"""A clock for ``StepScheduler`` tests: time moves only when the scheduler sleeps."""

from __future__ import annotations

from collections.abc import Callable, Iterable


class FakeClock:
    """Call it for the time; ``sleep`` advances it and runs the next of ``actions`` (a robot writing files)."""

    def __init__(self, actions: Iterable[Callable[[], object]] = ()) -> None:
        self.now = 0.0
        self.actions = list(actions)  # run one per sleep, in order

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        if self.actions:
            self.actions.pop(0)()
