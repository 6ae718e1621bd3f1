"""Round-level metrics shared by the speculative strategies."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class RoundStats:
    mode: str
    draft_len: int
    rounds: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    wait_s: float = 0.0
    accepted_hist: Counter = field(default_factory=Counter)
    hits: int = 0
    lookups: int = 0
    hits_by_k: Counter = field(default_factory=Counter)
    lookups_by_k: Counter = field(default_factory=Counter)
    backup_rounds: Counter = field(default_factory=Counter)
    draft_failures: list[str] = field(default_factory=list)

    @classmethod
    def merged(cls, parts: list["RoundStats"], mode: str, draft_len: int) -> "RoundStats":
        """The totals of several requests' stats (one batch of ``generate``)."""
        total = cls(mode=mode, draft_len=draft_len)
        for part in parts:
            total.rounds += part.rounds
            total.accepted += part.accepted
            total.accepted_hist.update(part.accepted_hist)
            total.hits += part.hits
            total.lookups += part.lookups
            total.hits_by_k.update(part.hits_by_k)
            total.lookups_by_k.update(part.lookups_by_k)
            total.backup_rounds.update(part.backup_rounds)
            total.draft_failures += [f for f in part.draft_failures if f not in total.draft_failures]
        return total

    def record_round(self, accepted: int) -> None:
        self.rounds += 1
        self.accepted += accepted
        self.accepted_hist[accepted] += 1

    def record_lookup(self, accepted: int, hit: bool) -> None:
        self.lookups += 1
        self.lookups_by_k[accepted] += 1
        if hit:
            self.hits += 1
            self.hits_by_k[accepted] += 1

    def note_draft_failure(self, failure: BaseException) -> None:
        """The draft failed while this request ran (recorded once per failure)."""
        text = f"{type(failure).__name__}: {failure}"
        if text not in self.draft_failures:
            self.draft_failures.append(text)

    def add_time(self, draft_s: float = 0.0, verify_s: float = 0.0, wait_s: float = 0.0) -> None:
        self.draft_s += draft_s
        self.verify_s += verify_s
        self.wait_s += wait_s

    def summary(self) -> dict:
        rounds = max(self.rounds, 1)
        busy = self.draft_s + self.verify_s + self.wait_s
        return {
            "mode": self.mode, "draft_len": self.draft_len, "rounds": self.rounds,
            "mean_accepted": self.accepted / rounds if self.rounds else None,
            "acceptance_rate": self.accepted / (rounds * self.draft_len) if self.rounds else None,
            "cache_hit_rate": (self.hits / self.lookups) if self.lookups else None,
            "cache_hit_rate_by_accepted": {k: self.hits_by_k[k] / n for k, n in sorted(self.lookups_by_k.items())}
            if self.lookups else None,
            "accepted_histogram": dict(sorted(self.accepted_hist.items())),
            "verify_latency_s": self.verify_s / self.rounds if self.rounds else None,
            "draft_latency_s": self.draft_s / self.rounds if self.rounds else None,
            "draft_time_share": self.draft_s / busy if busy else None,
            "verify_time_share": self.verify_s / busy if busy else None,
            "wait_time_share": self.wait_s / busy if busy else None,
            "backup_rounds": dict(self.backup_rounds), "draft_failures": list(self.draft_failures),
        }
