"""The contract between the control plane and a driver: names, events, commands and reports.

A driver (the simulator, emulated Ray workers or real engines, ``docs/architecture.md``) feeds *events* into
``Coordinator.handle(event)`` and gets back a list of *messages*: **commands** it must execute (start
generation, run a chunk, switch a pool, ...) and **reports** it records (a finished step, a borrowing decision,
the end of the run). Events carry the driver's timestamp ``t`` in seconds: the core uses it as data
(profiling records, idle windows), it never reads a clock of its own. Nothing else of the coordinator is part
of the contract, apart from its documented read-only :meth:`~bidirl.core.coordinator.Coordinator.view`.

Every name used by more than one module is defined here once: pools, roles, borrowing directions, trainer
stages, span kinds, policy names and worker names.

Workers are named ``<pool>/<role-kind>[/<i>]``:

* ``rollout_pool/rollouter/<i>``  primary rollout replicas (one inference engine each)
* ``trainer_pool/trainer``        primary trainers (one data-parallel gang over the trainer pool)
* ``trainer_pool/rollouter/<i>``  auxiliary rollout replicas (Rollouter-on-TrainerPool)
* ``rollout_pool/trainer``        auxiliary trainers (Trainer-on-RolloutPool, one gang)

A trainer gang executes a chunk together: each of its replicas takes an equal share of the chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from bidirl.core.checks import choice, finite, integer

# --------------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------------

ROLLOUT_POOL, TRAINER_POOL = "rollout_pool", "trainer_pool"
POOLS: tuple = (ROLLOUT_POOL, TRAINER_POOL)
#: the role of a worker on a pool: ``primary`` on its home pool, ``auxiliary`` on a borrowed one (§3.2)
PRIMARY, AUXILIARY = "primary", "auxiliary"
ROLES: tuple = (PRIMARY, AUXILIARY)
#: what a pool's workers do (``Switch.to_role``)
ROLLOUT, TRAINER = "rollout", "trainer"
#: the two borrowing directions (§5.2) and the pool each one borrows
ROLLOUT_ON_TRAINER_POOL, TRAINER_ON_ROLLOUT_POOL = "rollout_on_trainer_pool", "trainer_on_rollout_pool"
DIRECTIONS: tuple = (ROLLOUT_ON_TRAINER_POOL, TRAINER_ON_ROLLOUT_POOL)
BORROWED_POOL = {ROLLOUT_ON_TRAINER_POOL: TRAINER_POOL, TRAINER_ON_ROLLOUT_POOL: ROLLOUT_POOL}
DIRECTION_OF_POOL = {pool: direction for direction, pool in BORROWED_POOL.items()}
#: what a pool's own (primary) workers do, and what auxiliary workers on it do
HOME_ROLE = {ROLLOUT_POOL: ROLLOUT, TRAINER_POOL: TRAINER}
GUEST_ROLE = {ROLLOUT_POOL: TRAINER, TRAINER_POOL: ROLLOUT}

#: trainer stages in execution order (appendix, trainer model); the first two are forward passes
STAGES: tuple = ("old_logprob", "ref_logprob", "actor_update")
FORWARD_STAGES: tuple = ("old_logprob", "ref_logprob")
UPDATE_STAGES: tuple = ("actor_update",)

#: what a span of the event log can be (``bidirl.results.trace``); ``reprefill`` … ``rule_wait`` mark what borrowing costs inside
#: another span of the same lane (:data:`COST_SPAN_KINDS`)
SPAN_KINDS: tuple = ("generate", "chunk", "switch_in", "switch_out", "sync", "grad_merge", "optimizer",
                     "reprefill", "pin_alloc", "switch_no_work", "rule_wait", "weight_refresh")
#: ``weight_refresh`` is an auxiliary trainer gang receiving the primaries' weights after an optimizer step
#: (``RefreshWeights``).
#: spans that mark a cost inside another span of their lane, never work of their own: ``reprefill`` — a resumed or
#: moved request recomputing the KV cache of its prompt and kept prefix (inside ``generate``); ``pin_alloc`` — a
#: worker's first switch out allocating its pinned host buffer (inside ``switch_in``/``switch_out``);
#: ``switch_no_work`` — a switch of a window in which the borrowed pool ran nothing (the window closed before the
#: switch in completed, or nothing was left for it): both its switches were paid for no work
#: ``rule_wait`` — what the reproducible mode costs (``bidirl.core.schedule``): the primary trainer held for the
#: rule's batch while the default rule had one, or a sync held for groups in flight that partial rollout would cut
COST_SPAN_KINDS: tuple = ("reprefill", "pin_alloc", "switch_no_work", "rule_wait")

#: scheduling policies of the control plane (§7.3 ablations) and the modelled external systems (§7.1)
CORE_POLICIES: tuple = ("bidirl", "no-borrow", "rot-only", "tor-only", "opportunistic")
BASELINE_POLICIES: tuple = ("verl-colocated", "verl-async", "areal", "roll")
POLICY_NAMES: tuple = CORE_POLICIES + BASELINE_POLICIES

PRIMARY_TRAINER = f"{TRAINER_POOL}/trainer"
AUX_TRAINER = f"{ROLLOUT_POOL}/trainer"


def chunk_size(micro_batch_per_device: int, rho: int, d: int, sequence_parallel: int = 1) -> int:
    """Samples (units) in one full trainer chunk: one micro-batch of ``micro_batch_per_device`` samples on each of
    the ``rho · d`` devices of a gang of ``d`` replicas of ``rho`` devices (§5.2; ``rl.micro_batch_per_device``),
    or with Ulysses sequence parallelism of degree k (``rl.sequence_parallel``) on each of its ``rho · d / k``
    sequence-parallel groups (data parallel = devices / k; at least one micro-batch). The planner's M_t, the
    coordinator's gates and chunk queue and the drivers all cut chunks with this."""
    return max(int(micro_batch_per_device),
               int(micro_batch_per_device) * int(rho) * int(d) // int(sequence_parallel))


def mini_batch_bounds(n_samples: int, mini_batch) -> list:
    """The optimizer mini-batches ``[(lo, hi)]`` of a local update's ``n_samples`` samples, in batch order:
    ``mini_batch`` samples each (``rl.mini_batch_prompts`` × ``group_size``, veRL's ``ppo_mini_batch_size``; the
    config makes it divide the local update), or one over the whole batch when ``mini_batch`` is None or not
    smaller. The chunk queue's update segments and the planner's M_t cut the update stage with this (§5.2)."""
    n, m = int(n_samples), mini_batch
    if m is None or m >= n:
        return [(0, n)]
    if m <= 0:
        raise ValueError(f"mini_batch must be a positive sample count, got {m}")
    return [(lo, min(lo + m, n)) for lo in range(0, n, m)]


def packed_groups(devices: int, budget: int, sequence_parallel: int = 1) -> tuple:
    """``(micro-batches, tokens each)`` of one token-budget chunk on ``devices`` devices: one per
    sequence-parallel group of k devices, of k · ``budget`` tokens (veRL scales ``ppo_max_token_len_per_gpu`` by
    the Ulysses degree: the group's GPUs share each sample's tokens)."""
    k = int(sequence_parallel)
    return max(1, int(devices) // k), int(budget) * k


def packed_chunk_len(tokens, start: int, stop: int, devices: int, budget: int) -> int:
    """Samples in the token-budget chunk that starts at sample ``start`` (``rl.max_tokens_per_micro_batch``, veRL's
    dynamic batch size): the samples ``tokens[start:stop]`` (prompt + response tokens each), in order, are packed
    first-fit into ``devices`` micro-batches of at most ``budget`` tokens — a sample goes to the first
    micro-batch it fits, and the chunk ends before the first sample that fits none. A chunk holds at least one
    sample (validation guarantees every sample fits a budget: the config refuses a budget below the longest
    sample). The planner's M_t, the coordinator's chunk queue and gates and the drivers cut chunks with this."""
    free = []
    i = start
    while i < stop:
        need = int(tokens[i])
        for k, room in enumerate(free):
            if need <= room:
                free[k] = room - need
                break
        else:
            if len(free) == int(devices):
                break
            free.append(int(budget) - need)
        i += 1
    return max(1, i - start)


def trainer_stages(reference_model: bool, recompute_old_logprob: bool = True) -> tuple:
    """The stages a trainer step runs: ``ref_logprob`` only with a reference model, ``old_logprob`` unless the
    rollout's own log-probs stand in for it (veRL's ``bypass_mode``)."""
    skip = ({"ref_logprob"} if not reference_model else set()) | ({"old_logprob"} if not recompute_old_logprob
                                                                  else set())
    return tuple(s for s in STAGES if s not in skip)


def rollouter(pool: str, index: int) -> str:
    """The rollout replica ``index`` on ``pool`` (primary on the rollout pool, auxiliary on the trainer pool)."""
    return f"{pool}/rollouter/{int(index)}"


def trainer_gang(pool: str) -> str:
    """The trainer gang on ``pool`` (primary on the trainer pool, auxiliary on the rollout pool)."""
    return f"{pool}/trainer"


def worker_pool(worker: str) -> str:
    return worker.split("/", 1)[0]


def worker_kind(worker: str) -> str:
    """``rollout`` or ``trainer``: what the worker computes."""
    return ROLLOUT if worker.split("/")[1] == "rollouter" else TRAINER


def is_primary(worker: str) -> bool:
    """Primary workers live on their own pool: rollouters on the rollout pool, trainers on the trainer pool."""
    return HOME_ROLE[worker_pool(worker)] == worker_kind(worker)


def worker_role(worker: str) -> str:
    return PRIMARY if is_primary(worker) else AUXILIARY



# --------------------------------------------------------------------------------------------------
# Records (what reports carry, and the switch costs the scheduler charges)
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SwitchCosts:
    """Hot-switch costs of one borrowing direction in seconds (paper §3.2, Table 3): C_in, C_out, C_grad."""
    c_in: float
    c_out: float
    c_grad: float = 0.0


@dataclass(frozen=True)
class StepRecord:
    """One training step (paper §7.1's "metric step").

    ``start``: when the trainer began waiting for the step's batch; ``end``: when its optimizer step and weight
    sync finished; ``tokens``: prompt + response tokens consumed; ``wait`` / ``consume``: the waiting and the
    consuming part of the step; ``version``: the actor version the step produced.
    """
    step: int
    start: float
    end: float
    tokens: int
    samples: int
    wait: float = 0.0
    consume: float = 0.0
    version: int = 0

    def __post_init__(self):
        start, end = finite(self.start, "StepRecord", "start"), finite(self.end, "StepRecord", "end")
        if end < start:
            raise ValueError(f"StepRecord.end ({end!r}) is before StepRecord.start ({start!r}) "
                             f"for step {self.step}")
        object.__setattr__(self, "step", integer(self.step, "StepRecord", "step", 0))
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "end", end)
        object.__setattr__(self, "tokens", integer(self.tokens, "StepRecord", "tokens", 0))
        object.__setattr__(self, "samples", integer(self.samples, "StepRecord", "samples", 0))
        object.__setattr__(self, "wait", finite(self.wait, "StepRecord", "wait"))
        object.__setattr__(self, "consume", finite(self.consume, "StepRecord", "consume"))
        object.__setattr__(self, "version", integer(self.version, "StepRecord", "version"))


@dataclass(frozen=True)
class Decision:
    """One borrowing opportunity the scheduler evaluated at time ``t`` (paper §5.2, admission rule).

    ``direction`` is one of :data:`DIRECTIONS`; ``admitted`` whether the pool was lent; ``predicted_gain`` the
    predicted time saved; ``cost`` the switch overhead charged (C_in + C_out [+ C_grad]).
    """
    t: float
    direction: str
    admitted: bool
    predicted_gain: float
    cost: float
    detail: dict = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "t", finite(self.t, "Decision", "t"))
        choice(self.direction, DIRECTIONS, "Decision", "direction")
        if not isinstance(self.admitted, (bool, np.bool_)):
            raise ValueError(f"Decision.admitted must be a bool, got {self.admitted!r}")
        object.__setattr__(self, "admitted", bool(self.admitted))
        for name in ("predicted_gain", "cost"):
            try:
                object.__setattr__(self, name, float(getattr(self, name)))
            except (TypeError, ValueError):
                raise ValueError(f"Decision.{name} must be a number, got {getattr(self, name)!r}") from None
        if not isinstance(self.detail, dict):
            raise ValueError(f"Decision.detail must be a dict, got {type(self.detail).__name__}")


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
    payload: object = None

    @property
    def complete(self) -> bool:
        return all(self.done)

    @property
    def response_tokens(self) -> int:
        return int(sum(self.generated))

    @property
    def tokens(self) -> int:
        """Prompt + response tokens of every response (what a trainer consumes, §7.1)."""
        return self.prompt_len * len(self.generated) + self.response_tokens


@dataclass(frozen=True)
class GroupTask:
    """Generate (or resume) one group. ``resume`` holds the prefix state when the group was interrupted."""
    group_id: int
    resume: Optional[GroupState] = None


@dataclass(frozen=True)
class Chunk:
    """One executable trainer unit (§5.2, Table 2): at most ``per_device`` samples on each device of a gang
    (a replica of ρ_t devices takes up to ``per_device · ρ_t``).

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
# Commands: core -> driver (each driver has one handler per command, checked when it is built)
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Generate:
    """Generate (or resume) ``tasks`` on rollouter ``worker`` with actor ``version``'s weights."""
    worker: str
    tasks: tuple              # of GroupTask
    version: int


@dataclass(frozen=True)
class Interrupt:
    """Stop generating the listed groups (``None``: all of them); answered by ``GenerationStopped``."""
    worker: str
    group_ids: Optional[tuple] = None


@dataclass(frozen=True)
class StartStep:
    """Training step ``step`` (updating actor ``version``) consumes ``groups``, in batch order. With streaming
    consumption (``rl.updates_per_sync`` = U) a step is U local updates, each its own ``StartStep`` with the same step
    and version: ``local`` (0 … U − 1) tells them apart — a repeat of ``(step, local)`` is a rolled-back attempt
    starting over, a new ``local`` the next local update on the weights the earlier ones left."""
    step: int
    version: int
    groups: tuple             # of GroupState
    local: int = 0


@dataclass(frozen=True)
class RunChunk:
    """Run ``chunk`` on trainer gang ``worker``; answered by ``ChunkStarted`` then ``ChunkFinished``."""
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
    """Hand ``pool`` to ``to_role``: offload the passive role's state, onload the active one (§3.2).

    ``phase`` is ``in`` (lend the pool) or ``out`` (give it back); ``expected`` the cost the scheduler charged
    (C_in or C_out); ``version`` the actor version the incoming workers must hold. ``no_work`` (switch out only)
    says why the closing window sent the borrowed pool no work at all — empty when it sent some (§5.2: such a
    window paid both switches for nothing; drivers log it in the switch-out span's ``detail``).
    """
    pool: str
    to_role: str
    direction: str
    phase: str
    expected: float
    version: int
    no_work: str = ""


@dataclass(frozen=True)
class SyncWeights:
    """Push actor ``version`` from the primary trainer to ``targets`` (the primary rollouters)."""
    version: int
    targets: tuple


@dataclass(frozen=True)
class MergeGradients:
    """Move auxiliary trainers' actor-update gradients to the primary gang (C_grad), in chunk order."""
    step: int
    chunk_ids: tuple
    expected: float


@dataclass(frozen=True)
class OptimizerStep:
    """Apply the step's actor-update gradients on the primary trainers in ``merge_order`` (chunk ids, the
    original chunk order), producing actor ``version``. With optimizer mini-batches (``rl.mini_batch_prompts``) one
    is sent per mini-batch, over that mini-batch's chunks; all but the local update's last (``final``) keep the
    version. Drivers charge the local update's once-per-update costs (offload copies) with the ``final`` one."""
    step: int
    version: int
    merge_order: tuple
    final: bool = True


@dataclass(frozen=True)
class RefreshWeights:
    """Send the primary gang's current actor weights to the auxiliary trainer gang ``worker`` after an optimizer
    step that kept the version (an optimizer mini-batch's, or a streamed step's earlier local update's; §5.2), as
    every data-parallel member holds the same weights after a step. ``updates`` counts the optimizer steps since
    ``version`` the weights carry (0: the version's own weights, what the switch in loads); ``expected`` the
    transfer the scheduler charged (:func:`bidirl.perf.costs.aux_weight_transfer_time`). Answered by
    ``WeightsRefreshed``; the gang runs no chunk of the weights' segments before."""
    worker: str
    step: int
    version: int
    updates: int
    expected: float


COMMANDS: tuple = (Generate, Interrupt, StartStep, RunChunk, CancelChunk, Switch, SyncWeights, MergeGradients,
                   OptimizerStep, RefreshWeights)


# --------------------------------------------------------------------------------------------------
# Reports: core -> driver, records for the event log (the driver's execution layer keeps them)
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepDone:
    """A training step finished (its weights reached the rollouters)."""
    record: StepRecord


@dataclass(frozen=True)
class Decided:
    """The scheduler evaluated a borrowing opportunity (§5.2): admitted or not, with gain and cost."""
    decision: Decision


@dataclass(frozen=True)
class RunDone:
    """The configured number of steps is done; in-flight generation is being stopped."""
    t: float


@dataclass(frozen=True)
class RuleWaited:
    """The reproducible mode held ``worker`` over ``[start, end]``: ``held`` is ``"batch"`` (the trainer waited for
    the rule's groups while the default rule had a batch) or ``"sync"`` (the weight sync waited for groups in flight
    that partial rollout would have cut)."""
    worker: str
    held: str
    start: float
    end: float


REPORTS: tuple = (StepDone, Decided, RunDone, RuleWaited)


# --------------------------------------------------------------------------------------------------
# Events: driver -> core
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Started:
    """The driver is ready (workers initialised, auxiliaries passive)."""
    t: float


@dataclass(frozen=True)
class Resumed:
    """A run resumed from a checkpoint started its workers anew at ``t`` (fed before its boundary): their trainers
    reserve the first switches' pinned buffers from then on, ``first_switch`` the seconds of each,
    ``((direction, "in" | "out"), seconds)`` pairs (:func:`bidirl.perf.costs.first_switch_allocation`)."""
    t: float
    first_switch: tuple = ()


@dataclass(frozen=True)
class GroupFinished:
    """Every response of ``group`` finished on ``worker``."""
    t: float
    worker: str
    group: GroupState


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


@dataclass(frozen=True)
class WorkerFailed:
    """``worker`` (a rollouter, or a whole trainer gang) died or its call failed; the driver restarts it."""
    t: float
    worker: str
    error: str = ""


@dataclass(frozen=True)
class WorkerRestarted:
    """A failed ``worker`` is back: a fresh process holding the weights (and, for the primary trainer, the
    optimizer state) of the version it serves, offloaded if its pool is lent. It may take work again."""
    t: float
    worker: str


@dataclass(frozen=True)
class RolloutRecord:
    """A profiling record (§5.1): ``worker`` generated these responses, alone and from scratch, in
    ``elapsed`` seconds (one busy period of fresh groups)."""
    t: float
    worker: str
    prompt_lens: tuple
    response_lens: tuple
    elapsed: float


@dataclass(frozen=True)
class WeightsRefreshed:
    """The auxiliary gang ``worker`` holds the weights of ``RefreshWeights(step, version, updates)``."""
    t: float
    worker: str
    step: int
    version: int
    updates: int
    elapsed: float


EVENTS: tuple = (Started, Resumed, GroupFinished, GenerationStopped, ChunkStarted, ChunkFinished, ChunkCancelled,
                 SwitchFinished, SyncFinished, GradientsMerged, OptimizerStepped, WorkerFailed, WorkerRestarted,
                 RolloutRecord, WeightsRefreshed)
