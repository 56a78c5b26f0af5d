"""`TrimPolicy`: what a playout's latency recovery may take, decided apart from the timeline it acts on.

Pure (no clock: `now` is passed in), like the chunk loop's `characters.chunk_policy`. It keeps the slack of the
chunks committed over `slack_window_s` and how long chunks lately took to make, and answers: may `cut_s` of the
timeline go (`spare`), is it time to shed a queued idle chunk (`shed_due`), how late may an onset's audio be due
(`onset_slack`). The playout applies the answers (characters.pacing.playout, the module docstring's contract).
"""

from __future__ import annotations

import math
from collections import deque

from characters.pacing.config import PacingConfig


class TrimPolicy:
    """Latency recovery's decisions for one playout."""

    def __init__(self, cfg: PacingConfig) -> None:
        self.cfg = cfg
        self._slack: deque[tuple[float, float]] = deque()  # (committed at, slack) of the last slack_window_s
        self._made: deque[tuple[float, float]] = deque()  # (arrived at, time to make) of the last slack_window_s
        self._arrived: float | None = None  # when the last chunk arrived
        self._slack_from: float | None = None  # when the first chunk was committed
        self._deep_since: float | None = None  # since when the buffer has stayed a chunk deeper than the target

    def arrived(self, now: float, submitted_at: float | None) -> None:
        """A chunk arrived: it was made from its submit, or from the previous arrival if the pipeline was busy."""
        if submitted_at is not None:
            self._made.append((now, now - max(submitted_at, self._arrived if self._arrived is not None else -math.inf)))
            while self._made and self._made[0][0] < now - self.cfg.slack_window_s:
                self._made.popleft()
        self._arrived = now

    def committed(self, now: float, slack: float, *, onset: bool, early_s: float) -> None:
        """A chunk was committed `slack` seconds before its audio was needed (0 for a late one)."""
        if self._slack_from is None:
            self._slack_from = now
        if not onset:  # an onset's slack is onset_slack_s by design: it says nothing of the jitter
            self._slack.append((now, slack - early_s))  # a chunk made early had slack the pipeline did not
        while self._slack and self._slack[0][0] < now - self.cfg.slack_window_s:
            self._slack.popleft()

    def spare(self, now: float, cut_s: float) -> bool:
        """Whether `cut_s` of the timeline can go: always without `min_slack_s`; with it, only when the full
        window's chunks all had `cut_s` more slack than `min_slack_s`."""
        c = self.cfg
        if c.min_slack_s is None:
            return True
        return (self._slack_from is not None and now - self._slack_from >= c.slack_window_s and bool(self._slack)
                and min(x for _, x in self._slack) >= c.min_slack_s + cut_s)

    def take(self, cut_s: float) -> None:
        """The timeline is `cut_s` shorter: every chunk from now on has that much less slack."""
        self._slack = deque((t, x - cut_s) for t, x in self._slack)

    def shed_due(self, now: float, deep: bool) -> bool:
        """`deep`: chunks are queued a chunk deeper than the target, none of them speech. True once that has held
        for `shrink_after_s` and a chunk's duration can be spared: shed one idle chunk, then call `shed`."""
        if not deep:
            self._deep_since = None
            return False
        if self._deep_since is None:
            self._deep_since = now
            return False
        return now - self._deep_since >= self.cfg.shrink_after_s and self.spare(now, self.cfg.chunk_s)

    def shed(self) -> None:
        """An idle chunk was shed (`shed_due`)."""
        self._deep_since = None
        self.take(self.cfg.chunk_s)

    def not_deep(self) -> None:
        """The buffer ran dry or an onset cut it: the deep spell, if any, is over."""
        self._deep_since = None

    def onset_slack(self) -> float:
        """How long after now an onset's audio may be due: `onset_slack_s`, plus however much the slowest chunk of
        the window took to make beyond a chunk's duration (the chunk after the onset must still come in time)."""
        slow = max((x for _, x in self._made), default=0.0) - self.cfg.chunk_s
        return self.cfg.onset_slack_s + max(0.0, slow)

    def slack_min(self) -> float | None:
        """The least slack of the chunks committed in the window."""
        return min((x for _, x in self._slack), default=None)
