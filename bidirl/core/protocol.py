"""The messages between the control plane and a driver (DESIGN.md, "One control plane, three data planes").

A driver (the simulator, or the Ray runtime with emulated or engine workers) feeds *events* into
``Coordinator.handle(event)`` and executes the *commands* it gets back. Events carry the driver's
timestamp ``t`` in seconds: the core uses it as data (profiling records, idle windows), it never reads
a clock of its own.

Workers are named ``<pool>/<role-kind>[/<index>]``:

* ``rollout_pool/rollouter/<i>``  primary rollout replicas (one vLLM engine each)
* ``trainer_pool/trainer``        primary trainers (one data-parallel gang over the trainer pool)
* ``trainer_pool/rollouter/<i>``  auxiliary rollout replicas (Rollouter-on-TrainerPool)
* ``rollout_pool/trainer``        auxiliary trainers (Trainer-on-RolloutPool, one gang)

A trainer gang executes a chunk together: each of its replicas takes one micro-batch of the chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

Pool = Literal["rollout_pool", "trainer_pool"]
Role = Literal["rollout", "trainer"]
Stage = Literal["old_logprob", "ref_logprob", "actor_update"]
STAGES: tuple = ("old_logprob", "ref_logprob", "actor_update")
ROLLOUT_POOL: Pool = "rollout_pool"
TRAINER_POOL: Pool = "trainer_pool"


def worker_pool(worker: str) -> Pool:
    return worker.split("/", 1)[0]  # type: ignore[return-value]


def worker_kind(worker: str) -> Role:
    return "rollout" if worker.split("/")[1] == "rollouter" else "trainer"


def is_primary(worker: str) -> bool:
    """Primary workers live on their own pool: rollouters on the rollout pool, trainers on the trainer pool."""
    return (worker_pool(worker) == ROLLOUT_POOL) == (worker_kind(worker) == "rollout")


# --------------------------------------------------------------------------------------------------
# Work units
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GroupState:
    """A prompt-level rollout group as it stands: finished responses and the prefixes of unfinished ones.

    ``generated[i]`` is the number of tokens response ``i`` holds, ``done[i]`` whether it finished.
    ``version`` is the oldest actor version that generated any of its tokens (the staleness tag, see
    ``bidirl.core.staleness``). ``payload`` is the driver's own data (token ids, log-probs): the core
    passes it through untouched.
    """
    group_id: int
    prompt_len: int
    generated: tuple
    done: tuple
    version: int
    payload: Any = None

    @property
    def complete(self) -> bool:
        return all(self.done)

    @property
    def response_tokens(self) -> int:
        return int(sum(self.generated))


@dataclass(frozen=True)
class GroupTask:
    """Generate (or resume) one group. ``resume`` holds the prefix state when the group was interrupted."""
    group_id: int
    resume: Optional[GroupState] = None


@dataclass(frozen=True)
class Chunk:
    """One executable trainer unit (§5.2, Table 2): ``per_device`` samples on each replica of a gang.

    ``samples`` are ``(group_id, response_index)`` pairs in the original batch order; ``order`` is the
    chunk's position in the stage-ordered workload, used for the ordered merge.
    """
    chunk_id: int
    step: int
    stage: str
    order: int
    samples: tuple
    per_device: int


# --------------------------------------------------------------------------------------------------
# Commands: core -> driver
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Generate:
    worker: str
    tasks: tuple              # of GroupTask
    version: int              # the weights the worker holds


@dataclass(frozen=True)
class Interrupt:
    """Stop generating the listed groups (``None``: all of them); answered by ``GenerationStopped``."""
    worker: str
    group_ids: Optional[tuple] = None
    reason: str = "sync"


@dataclass(frozen=True)
class RunChunk:
    worker: str
    chunk: Chunk
    version: int


@dataclass(frozen=True)
class CancelChunk:
    """Reclaim a queued chunk; answered by ``ChunkCancelled`` if it had not started, else it finishes."""
    worker: str
    chunk_id: int


@dataclass(frozen=True)
class Switch:
    """Hand ``pool`` to ``to_role``: offload the passive role's state, onload the active one (§3.2)."""
    pool: str
    to_role: str
    direction: str            # "rollout_on_trainer_pool" | "trainer_on_rollout_pool"
    phase: str                # "in" (lend the pool) | "out" (give it back)
    expected: float           # the cost the scheduler charged for it (C_in or C_out)


@dataclass(frozen=True)
class SyncWeights:
    """Push actor ``version`` from the primary trainer to ``targets`` (rollouters or auxiliary trainers)."""
    version: int
    targets: tuple
    expected: float


@dataclass(frozen=True)
class MergeGradients:
    """Move auxiliary trainers' actor-update gradients to the primary gang (C_grad), in chunk order."""
    step: int
    chunk_ids: tuple
    expected: float


@dataclass(frozen=True)
class OptimizerStep:
    """Apply the merged gradients on the primary trainers, producing actor ``version``."""
    step: int
    version: int


# --------------------------------------------------------------------------------------------------
# Events: driver -> core
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Started:
    """The driver is ready (workers initialised, auxiliaries passive)."""
    t: float


@dataclass(frozen=True)
class GroupFinished:
    t: float
    worker: str
    group: GroupState
    elapsed: float = 0.0      # generation time of this group on the worker


@dataclass(frozen=True)
class GenerationStopped:
    """Answer to ``Interrupt``: groups that were on the worker, complete or as prefixes."""
    t: float
    worker: str
    groups: tuple             # of GroupState


@dataclass(frozen=True)
class ChunkStarted:
    t: float
    worker: str
    chunk_id: int


@dataclass(frozen=True)
class ChunkFinished:
    t: float
    worker: str
    chunk_id: int
    elapsed: float
    payload: Any = None       # the gradient handle / log-probs, passed through to the merge


@dataclass(frozen=True)
class ChunkCancelled:
    t: float
    worker: str
    chunk_id: int


@dataclass(frozen=True)
class SwitchFinished:
    t: float
    pool: str
    to_role: str
    elapsed: float


@dataclass(frozen=True)
class SyncFinished:
    t: float
    version: int
    targets: tuple
    elapsed: float


@dataclass(frozen=True)
class GradientsMerged:
    t: float
    step: int
    elapsed: float


@dataclass(frozen=True)
class OptimizerStepped:
    t: float
    step: int
    version: int
    payload: Any = None       # e.g. loss / reward statistics from the primary trainer


@dataclass(frozen=True)
class WorkerFailed:
    t: float
    worker: str
    error: str = ""


@dataclass(frozen=True)
class RolloutRecord:
    """A profiling record (§5.1) pushed by a driver outside the group path, e.g. per-engine timings."""
    t: float
    record: Any = field(default=None)
