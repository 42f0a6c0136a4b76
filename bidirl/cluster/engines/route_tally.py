"""The run's count of route replay (R3, docs/architecture.md "MoE"): which trainer chunks replayed the rollout's
routes for every token they fed, and the train–inference log-prob gap without the replay where it was compared.

The trainer ranks report, per call, the tokens whose routes their forward replayed (``replayed_tokens``, from
:class:`bidirl.rl.route_replay.RouteReplay`'s own count) beside the tokens the chunk's samples feed
(``fed_tokens``); a chunk counts as replayed when the two agree over its ranks and are not zero. The counts are part
of the driver's checkpoint state, so a resumed run reports the whole run."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RouteTally:
    """Chunks and tokens of the run's trainer stages, replayed or not (module docstring)."""
    on: bool
    chunks: dict = field(default_factory=dict)      # stage -> chunks run
    replayed: dict = field(default_factory=dict)    # stage -> chunks whose every fed token was replayed
    tokens: int = 0                                 # tokens whose routes were replayed (all stages)

    def chunk(self, stage: str, replayed_tokens: int, fed_tokens: int) -> None:
        """Count one chunk of ``stage`` (its ranks' replayed tokens summed) that feeds ``fed_tokens`` tokens."""
        self.chunks[stage] = self.chunks.get(stage, 0) + 1
        if self.on and fed_tokens > 0 and replayed_tokens == fed_tokens:
            self.replayed[stage] = self.replayed.get(stage, 0) + 1
        self.tokens += int(replayed_tokens)

    def summary(self) -> dict:
        total, replayed = sum(self.chunks.values()), sum(self.replayed.values())
        return {"on": self.on, "chunks": total, "replayed_chunks": replayed,
                "every_chunk_replayed": bool(self.on and total and replayed == total),
                "per_stage": {s: {"chunks": n, "replayed": self.replayed.get(s, 0)} for s, n in self.chunks.items()},
                "tokens": self.tokens}

    def state(self) -> dict:
        return {"chunks": dict(self.chunks), "replayed": dict(self.replayed), "tokens": self.tokens}

    def restore(self, state: dict) -> None:
        self.chunks, self.replayed = dict(state["chunks"]), dict(state["replayed"])
        self.tokens = int(state["tokens"])
