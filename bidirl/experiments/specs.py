"""The paper's evaluation (§7) as data: one declarative :class:`PanelSpec` per figure panel.

Settings common to the paper's runs (§7.1, "Experimental Setup"): Qwen3-VL-2B / Qwen3-VL-4B on Geo3K and
Qwen3-8B on GSM8K; max response length 1K–4K; staleness bounds 0–4; budgets of 8–32 GPUs; default
Qwen3-VL-4B on Geo3K, max response 2K, 64 prompts per step (128 on H100), GRPO group size 8, s = 1, two
8-GPU nodes split 8-8 node-aligned for the end-to-end runs (§7.2); ablations on a 4-12 split with 60
prompts, the Qwen3-8B/GSM8K ablation on 8-8 with 256 prompts (§7.3); static-planning partition sweeps for
2B on 16 and 4B on 32 GPUs (§7.4).

Each spec records what the paper says (``paper``) and every value it had to assume (``assumptions``);
:attr:`PanelSpec.doc` joins both. The paper's figures carry no axis values in the text, so the swept
values below are the paper's stated ranges filled in with the smallest natural grid.

A spec only describes the grid; :mod:`bidirl.experiments.run` executes it and
:mod:`bidirl.experiments.report` checks the results against ``data/paper/claims.yaml``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional, Union

from bidirl.job import config as cfgmod

KINDS = ("end-to-end", "ablation", "static", "stage-model")
METRICS = ("throughput", "total_run_throughput")

#: the external systems compared end to end (§7.1, "Baselines")
E2E_POLICIES = ("bidirl", "verl-colocated", "verl-async", "areal", "roll")
#: the ablated variants (§7.3, "Ablation variants"); rot-only = "w/o T-on-R", tor-only = "w/o R-on-T"
ABLATION_POLICIES = ("bidirl", "no-borrow", "rot-only", "tor-only", "opportunistic")

#: measured steps per run: the paper's (commented) text says 6 selected steps
MEASURED_STEPS = 6
QUICK_MEASURED_STEPS = 2


def _freeze(mapping: Optional[Mapping[str, Any]]) -> tuple:
    """A mapping as a sorted tuple of (key, value) pairs, so specs stay frozen and hashable."""
    if not mapping:
        return ()
    out = []
    for key, value in sorted(mapping.items()):
        if isinstance(value, list):
            value = tuple(value)
        if isinstance(value, dict):
            raise ValueError(f"override {key!r}: write nested values with dotted keys, not a mapping")
        out.append((str(key), value))
    return tuple(out)


@dataclass(frozen=True)
class Point:
    """One x-axis value of a panel: its label (used in claims), the value plotted, the config overrides."""
    label: str
    value: Any
    overrides: tuple = ()

    @classmethod
    def of(cls, label: str, value: Any, overrides: Optional[Mapping[str, Any]] = None) -> "Point":
        return cls(label, value, _freeze(overrides))

    def override_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.overrides}


@dataclass(frozen=True)
class PanelSpec:
    """One figure panel of §7: a grid of (policy × point) runs on one base configuration.

    ``base`` names an example config (``data/configs/<name>.yaml``) or is a frozen mapping; ``common``
    overrides apply to every point, then the point's own. ``policies`` are simulated at every point
    (``stage-model`` panels simulate nothing). ``metric`` is the throughput the panel compares:
    ``throughput`` (§7.1, head/tail steps dropped) for end-to-end panels, ``total_run_throughput`` (all
    complete steps) for ablation and static-split sweeps, as the paper's source notes say.
    """
    id: str
    title: str
    figure: str
    kind: str
    base: Union[str, tuple]
    hardware: str
    variable: str
    points: tuple
    policies: tuple
    claims: tuple
    common: tuple = ()
    metric: str = "throughput"
    measured_steps: int = MEASURED_STEPS
    quick_labels: tuple = ()
    seed: int = 0
    paper: str = ""
    assumptions: tuple = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"panel {self.id}: kind {self.kind!r} is not one of {KINDS}")
        if self.metric not in METRICS:
            raise ValueError(f"panel {self.id}: metric {self.metric!r} is not one of {METRICS}")
        if not self.points:
            raise ValueError(f"panel {self.id}: needs at least one point")
        labels = [p.label for p in self.points]
        if len(set(labels)) != len(labels):
            raise ValueError(f"panel {self.id}: point labels must be unique, got {labels}")
        unknown = set(self.quick_labels) - set(labels)
        if unknown:
            raise ValueError(f"panel {self.id}: quick_labels {sorted(unknown)} are not point labels {labels}")
        if self.measured_steps < 1:
            raise ValueError(f"panel {self.id}: measured_steps must be ≥ 1, got {self.measured_steps}")

    # ------------------------------------------------------------------------------------------
    @property
    def doc(self) -> str:
        """What the paper says about this panel and what had to be assumed."""
        lines = [f"{self.title} ({self.figure})", "", "Paper: " + self.paper]
        if self.assumptions:
            lines += ["", "Assumed:"] + [f"  - {a}" for a in self.assumptions]
        return "\n".join(lines)

    @property
    def values(self) -> tuple:
        return tuple(p.value for p in self.points)

    @property
    def labels(self) -> tuple:
        return tuple(p.label for p in self.points)

    @property
    def comparators(self) -> tuple:
        """The policies BiDiRL is compared with (all but ``bidirl``)."""
        return tuple(p for p in self.policies if p != "bidirl")

    def point(self, label: str) -> Point:
        for p in self.points:
            if p.label == label:
                return p
        raise KeyError(f"panel {self.id} has no point {label!r}; points: {list(self.labels)}")

    def base_config(self) -> cfgmod.JobConfig:
        base = self.base if isinstance(self.base, str) else dict(self.base)
        return cfgmod.load(base)

    def config(self, point: Union[Point, str]) -> cfgmod.JobConfig:
        """The job for one point: base, then ``hardware`` and ``common``, then the point's overrides,
        with ``workload.steps`` = measured steps + the steps §7.1 drops for the point's staleness."""
        if isinstance(point, str):
            point = self.point(point)
        overrides = {"hardware": self.hardware, "seed": self.seed}
        overrides.update({k: (list(v) if isinstance(v, tuple) else v) for k, v in self.common})
        overrides.update(point.override_dict())
        cfg = self.base_config().with_overrides(overrides)
        return cfg.with_overrides({"workload.steps": self.steps_for(cfg.rl.staleness)})

    def steps_for(self, staleness: float) -> int:
        """Measured steps plus the dropped ones: max(1, ⌈s⌉) at the head and ⌈s⌉ at the tail (§7.1)."""
        lag = math.ceil(staleness)
        return self.measured_steps + max(1, lag) + lag

    def quick(self) -> "PanelSpec":
        """A CI-sized variant: fewer measured steps and only ``quick_labels`` (default: first and last point)."""
        keep = set(self.quick_labels) or {self.points[0].label, self.points[-1].label}
        points = tuple(p for p in self.points if p.label in keep)
        return replace(self, points=points, quick_labels=(),
                       measured_steps=min(self.measured_steps, QUICK_MEASURED_STEPS))


# --------------------------------------------------------------------------------------------------
# Shared point builders
# --------------------------------------------------------------------------------------------------

def _response_points() -> tuple:
    return tuple(Point.of(f"{n}K", n * 1024, {"workload.max_response_len": n * 1024}) for n in (1, 2, 4))


STALENESS_VALUES = (0.0, 0.5, 1.0, 2.0, 4.0)


def _staleness_points() -> tuple:
    return tuple(Point.of(f"s={s:g}", s, {"rl.staleness": s}) for s in STALENESS_VALUES)


def _budget_points(pairs) -> tuple:
    """Points ``(gpus, rollout, trainer[, prompts])`` sweeping the GPU budget with a fixed split ratio."""
    out = []
    for item in pairs:
        gpus, rollout, trainer = item[:3]
        over = {"cluster.gpus": gpus, "cluster.partition": (rollout, trainer)}
        label = f"{gpus} GPUs"
        value = gpus
        if len(item) > 3:
            over["workload.prompts_per_step"] = item[3]
            label = f"{gpus} GPUs/B{item[3]}"
            value = (gpus, item[3])
        out.append(Point.of(label, value, over))
    return tuple(out)


def _partition_points(gpus: int, rollouts) -> tuple:
    return tuple(Point.of(f"{r}-{gpus - r}", r, {"cluster.partition": (r, gpus - r)}) for r in rollouts)


def _model_points(vl_batch: int, vl_partition: tuple, text_batch: int, text_partition: tuple) -> tuple:
    return (
        Point.of("2B/Geo3K", "qwen3-vl-2b/geo3k", {"model": "qwen3-vl-2b", "workload.dataset": "geo3k",
                                                   "workload.prompts_per_step": vl_batch,
                                                   "cluster.partition": vl_partition}),
        Point.of("4B/Geo3K", "qwen3-vl-4b/geo3k", {"model": "qwen3-vl-4b", "workload.dataset": "geo3k",
                                                   "workload.prompts_per_step": vl_batch,
                                                   "cluster.partition": vl_partition}),
        Point.of("8B/GSM8K", "qwen3-8b/gsm8k", {"model": "qwen3-8b", "workload.dataset": "gsm8k",
                                                "workload.prompts_per_step": text_batch,
                                                "cluster.partition": text_partition}),
    )


_DEFAULTS_A6000 = ("a6000-default: Qwen3-VL-4B, Geo3K, 16 A6000 GPUs in 2 nodes split 8-8 node-aligned, "
                   "64 prompts x group 8, max response 2K, s = 1 (§7.1 defaults)")
_DEFAULTS_H100 = ("h100-default: as the A6000 default with 128 prompts per step "
                  "(§7.1: 'The batch size is doubled on H100 devices')")
_TEXT_RUN = ("Qwen3-8B/GSM8K uses 256 prompts on an 8-8 split (§7.3: 'the 8-8 partition and prompt batch size "
             "256 used by the corresponding end-to-end text run'); its max response length stays 2K")
_STEPS = (f"{MEASURED_STEPS} measured steps per run (the paper's source comment: 'the number of selected steps "
          "is 6'), plus the max(1, ceil(s)) head and ceil(s) tail steps §7.1 drops")


# --------------------------------------------------------------------------------------------------
# §7.2 end-to-end panels (Fig. eval-main)
# --------------------------------------------------------------------------------------------------

def _e2e(hw: str) -> list:
    h100 = hw == "h100"
    tag = "H100" if h100 else "A6000"
    base = "h100-default" if h100 else "a6000-default"
    defaults = _DEFAULTS_H100 if h100 else _DEFAULTS_A6000
    batch = 128 if h100 else 64
    sub = (lambda a, e: e) if h100 else (lambda a, e: a)
    panels = [
        PanelSpec(
            id=f"e2e-{hw}-response", title=f"Response length ({tag})",
            figure=f"Fig. eval-main ({sub('a', 'e')})", kind="end-to-end", base=base, hardware=hw,
            variable="workload.max_response_len", points=_response_points(), policies=E2E_POLICIES,
            claims=(f"e2e-{hw}-response", "e2e-overall", "e2e-unsupported-marks")
            + (("e2e-h100-default",) if h100 else ("e2e-a6000-overall", "e2e-a6000-response-1k",
                                                   "e2e-a6000-response-2k", "e2e-a6000-response-4k")),
            quick_labels=("1K", "4K"),
            paper=("Max response lengths 1K-4K (§7.1). " + ("H100: 1.29x-1.47x." if h100 else
                   "A6000: 1.27x-1.55x; 1.55x / 1.45x / 1.27x at 1K / 2K / 4K (§7.2).")),
            assumptions=(defaults, "points 1K, 2K, 4K = 1024, 2048, 4096 tokens", _STEPS)),
        PanelSpec(
            id=f"e2e-{hw}-staleness", title=f"Staleness ({tag})",
            figure=f"Fig. eval-main ({sub('b', 'f')})", kind="end-to-end", base=base, hardware=hw,
            variable="rl.staleness", points=_staleness_points(), policies=E2E_POLICIES,
            claims=(f"e2e-{hw}-staleness", "e2e-overall", "e2e-s0-colocated", "e2e-unsupported-marks")
            + (("e2e-h100-default",) if h100 else ("e2e-a6000-overall",)),
            quick_labels=("s=0", "s=0.5", "s=1"),
            paper=("Staleness bounds 0 to 4 (§7.1); fractional 0 < s < 1 is unsupported by ROLL and AReaL (x). "
                   "At s = 0 BiDiRL is compared with veRL colocated (similar throughput); for s > 0 "
                   + ("1.26x-1.39x on H100." if h100 else "1.45x-1.68x on A6000.")),
            assumptions=(defaults, "points s = 0, 0.5, 1, 2, 4 (the paper names 0-4 and a fractional value; "
                         "0.5 is one of veRL's documented staleness_threshold values)", _STEPS)),
        PanelSpec(
            id=f"e2e-{hw}-resource", title=f"Resource, batch 128 ({tag})",
            figure=f"Fig. eval-main ({sub('c', 'g')})", kind="end-to-end", base=base, hardware=hw,
            variable="cluster.gpus", points=_budget_points([(8, 4, 4), (16, 8, 8), (32, 16, 16)]),
            policies=E2E_POLICIES, common=_freeze({"workload.prompts_per_step": 128}),
            claims=(f"e2e-{hw}-resource", "e2e-overall", "e2e-unsupported-marks")
            + (() if h100 else ("e2e-a6000-scaleup-max",)),
            paper=("128 prompts across 8 to 32 devices (§7.2): "
                   + ("1.05x-1.53x on H100." if h100 else "1.38x-1.94x on A6000; 'the scale-up setting reaches 1.94x'.")),
            assumptions=(defaults, "budgets 8, 16, 32 GPUs, each split evenly between the pools (4-4, 8-8, "
                         "16-16), node-aligned as the end-to-end runs are", _STEPS)),
        PanelSpec(
            id=f"e2e-{hw}-model", title=f"Model/dataset ({tag})",
            figure=f"Fig. eval-main ({sub('d', 'h')})", kind="end-to-end", base=base, hardware=hw,
            variable="model/dataset", points=_model_points(batch, (8, 8), 256, (8, 8)),
            policies=E2E_POLICIES,
            claims=(f"e2e-{hw}-model", "e2e-overall", "e2e-unsupported-marks")
            + (("e2e-h100-default",) if h100 else ("e2e-a6000-overall",)),
            paper=("Qwen3-VL-2B and Qwen3-VL-4B on Geo3K, Qwen3-8B on GSM8K (§7.1): "
                   + ("1.23x-1.31x on H100." if h100 else "1.34x-1.45x on A6000.")),
            assumptions=(defaults, _TEXT_RUN
                         + (" (the same 256 on H100: the paper states one text-run batch)" if h100 else ""),
                         _STEPS)),
        PanelSpec(
            id=f"e2e-{hw}-scaling", title=f"Batch/resource scaling ({tag})",
            figure=f"Fig. eval-main ({sub('i', 'j')})", kind="end-to-end", base=base, hardware=hw,
            variable="cluster.gpus & workload.prompts_per_step",
            points=_budget_points([(8, 4, 4, batch // 2), (16, 8, 8, batch), (32, 16, 16, batch * 2)]),
            policies=E2E_POLICIES,
            claims=(f"e2e-{hw}-scaling", "e2e-overall", "e2e-unsupported-marks")
            + (("e2e-h100-default",) if h100 else ("e2e-a6000-overall",)),
            paper=("'changing batch size together with device count does not make a fixed partition universally "
                   "balanced' (§7.2): " + ("1.30x-1.41x on H100." if h100 else "1.29x-1.45x on A6000.")),
            assumptions=(defaults, f"batch proportional to the budget: 8/16/32 GPUs with {batch // 2}/{batch}/"
                         f"{batch * 2} prompts, split evenly", _STEPS)),
    ]
    if h100:
        for model, letter, rng in (("4b", "k", "1.24x-1.41x"), ("2b", "l", "1.11x-1.41x")):
            panels.append(PanelSpec(
                id=f"e2e-h100-partition-{model}", title=f"Resource partition, Qwen3-VL-{model.upper()} (H100)",
                figure=f"Fig. eval-main ({letter})", kind="end-to-end", base=base, hardware=hw,
                variable="cluster.partition", points=_partition_points(32, (8, 16, 24)), policies=E2E_POLICIES,
                common=_freeze({"model": f"qwen3-vl-{model}", "cluster.gpus": 32,
                                "workload.prompts_per_step": 120}),
                claims=(f"e2e-h100-partition-{model}", "e2e-h100-partition", "e2e-overall",
                        "e2e-unsupported-marks"),
                quick_labels=("8-24", "16-16"),
                paper=(f"Resource-partition sweep on 32 H100 GPUs, batch 120: {rng} (§7.2). AReaL needs the batch "
                       "divisible by rollout data parallelism; the batch-120 16-16 point is unsupported (§7.1)."),
                assumptions=(_DEFAULTS_H100 + ", here with 120 prompts and Qwen3-VL-" + model.upper(),
                             "partitions 8-24, 16-16, 24-8 (node-aligned splits of 4 nodes; with them only 16-16 "
                             "breaks AReaL's rule, as the paper says)", _STEPS)))
    return panels


# --------------------------------------------------------------------------------------------------
# §7.3 ablation panels (Fig. eval-ablation), A6000
# --------------------------------------------------------------------------------------------------

_ABL_COMMON = {"cluster.partition": (4, 12), "cluster.placement": "any", "workload.prompts_per_step": 60}
_ABL_ASSUME = ("a6000-default with a 4-12 rollout/trainer split of 16 GPUs and 60 prompts (§7.3); placement "
               "'any' because 4-12 is not a whole-node split")
_ABL_METRIC = ("total-run throughput over all complete steps (§7.3: 'under the total-run throughput metric'; "
               "the paper's source notes: ablation runs report total-run throughput)")


def _ablation() -> list:
    common = _freeze(_ABL_COMMON)
    claims_all = ("abl-overall", "abl-over-no-borrow", "abl-over-opportunistic", "abl-over-rot-only",
                  "abl-over-tor-only", "abl-over-one-direction")
    return [
        PanelSpec(
            id="abl-response", title="Ablation: response length", figure="Fig. eval-ablation (a)",
            kind="ablation", base="a6000-default", hardware="a6000", variable="workload.max_response_len",
            points=_response_points(), policies=ABLATION_POLICIES, common=common,
            metric="total_run_throughput", claims=("abl-response",) + claims_all, quick_labels=("1K", "4K"),
            paper="1.02x-1.06x over the strongest ablated variant (Fig. eval-ablation a).",
            assumptions=(_ABL_ASSUME, "points 1K, 2K, 4K", _ABL_METRIC, _STEPS)),
        PanelSpec(
            id="abl-staleness", title="Ablation: staleness", figure="Fig. eval-ablation (b)",
            kind="ablation", base="a6000-default", hardware="a6000", variable="rl.staleness",
            points=_staleness_points(), policies=ABLATION_POLICIES, common=common,
            metric="total_run_throughput", claims=("abl-staleness",) + claims_all, quick_labels=("s=0", "s=1"),
            paper=("1.06x-1.12x over the strongest ablated variant; s = 0 and 0 < s < 1 with fast rollout expose "
                   "both T_wait and T_consume windows (§7.3)."),
            assumptions=(_ABL_ASSUME, "points s = 0, 0.5, 1, 2, 4", _ABL_METRIC, _STEPS)),
        PanelSpec(
            id="abl-resource", title="Ablation: resource, batch 120", figure="Fig. eval-ablation (c)",
            kind="ablation", base="a6000-default", hardware="a6000", variable="cluster.gpus",
            points=_budget_points([(16, 4, 12), (24, 8, 16), (32, 8, 24)]), policies=ABLATION_POLICIES,
            common=_freeze({**_ABL_COMMON, "workload.prompts_per_step": 120}),
            metric="total_run_throughput", claims=("abl-resource",) + claims_all,
            paper="Resource sweep with 120 prompts: 1.00x-1.09x over the strongest ablated variant.",
            assumptions=(_ABL_ASSUME.replace("60 prompts", "120 prompts (panel title)"),
                         "budgets 16, 24, 32 GPUs split 4-12, 8-16, 8-24: the 4B trainer replica needs 4 A6000 "
                         "GPUs and hot switching needs whole replicas of both roles on each pool, so 8 GPUs (2-6) "
                         "and a 6-18 split are infeasible; 24 GPUs therefore uses 8-16", _ABL_METRIC, _STEPS)),
        PanelSpec(
            id="abl-model", title="Ablation: model/dataset", figure="Fig. eval-ablation (d)",
            kind="ablation", base="a6000-default", hardware="a6000", variable="model/dataset",
            points=_model_points(60, (4, 12), 256, (8, 8)), policies=ABLATION_POLICIES, common=common,
            metric="total_run_throughput", claims=("abl-model",) + claims_all,
            paper=("1.04x-1.13x; the Qwen3-8B/GSM8K ablation uses the 8-8 partition and 256 prompts 'to avoid "
                   "OOM' (§7.3)."),
            assumptions=(_ABL_ASSUME, _TEXT_RUN, _ABL_METRIC, _STEPS)),
    ]


# --------------------------------------------------------------------------------------------------
# §7.4 static planning (Fig. eval-static a/b) and stage-time model validation (c/d)
# --------------------------------------------------------------------------------------------------

def _static() -> list:
    out = []
    for model, gpus, rollouts, chosen, spread, letter, shown in (
            ("2b", 16, (4, 8, 12), "8-8", "1.40x", "a",
             "displayed partitions: every split in steps of 4 GPUs (half a node), since 16 GPUs have only one "
             "whole-node split; the 4-12 split of the ablation is one of them"),
            ("4b", 32, (8, 16, 24), "8-24", "2.09x", "b",
             "displayed partitions: the machine-aligned splits (whole 8-GPU nodes), as §7.4 says; the same "
             "three partitions calibrate train_mfu and decode_mbu (bidirl.experiments.paper_fit)")):
        out.append(PanelSpec(
            id=f"static-{model}", title=f"Static planning: Qwen3-VL-{model.upper()} on {gpus} A6000 GPUs",
            figure=f"Fig. eval-static ({letter})", kind="static", base="a6000-default", hardware="a6000",
            variable="cluster.partition", points=_partition_points(gpus, rollouts), policies=("no-borrow",),
            common=_freeze({"model": f"qwen3-vl-{model}", "cluster.gpus": gpus, "cluster.placement": "any"}),
            metric="total_run_throughput",
            claims=(f"static-spread-{model}", f"static-choice-{model}", "static-choice-is-measured-best"),
            quick_labels=tuple(dict.fromkeys((chosen, f"{rollouts[0]}-{gpus - rollouts[0]}",
                                              f"{rollouts[-1]}-{gpus - rollouts[-1]}")))[:2],
            paper=(f"Measured throughput varies by {spread} across the displayed machine-aligned partitions; the "
                   f"planner selects {chosen}, the measured best (§7.4)."),
            assumptions=(_DEFAULTS_A6000.split(":")[0] + f" with Qwen3-VL-{model.upper()} on {gpus} GPUs",
                         shown,
                         "'measured' throughput = simulated total-run throughput with borrowing disabled "
                         "(no-borrow), so the partition alone sets it; the paper does not say which policy ran",
                         "predicted throughput = the planner's pipeline rate λ_pipe (bidirl.job.planner.plan) on "
                         "the same partitions", _STEPS)))
    out.append(PanelSpec(
        id="stage-rollout", title="Stage-time model: rollout (M_r)", figure="Fig. eval-static (c)",
        kind="stage-model", base="a6000-default", hardware="a6000", variable="prompts per GPU",
        points=tuple(Point.of(f"{n}p@{k}K", (n, k * 1024), {"workload.max_response_len": k * 1024})
                     for k in (2, 4) for n in (2, 4, 8, 16)),
        policies=(), claims=("stage-rollout-median", "stage-rollout-p90"),
        quick_labels=tuple(f"{n}p@{k}K" for k in (2, 4) for n in (2, 4, 8, 16)),   # cheap: quick only repeats less
        paper=("The rollout time increases with prompts per GPU and the 2K and 4K curves stay separated; median "
               "error 3.12 %, p90 5.77 % (§7.4)."),
        assumptions=("Qwen3-VL-4B on Geo3K, A6000, one rollout replica per GPU",
                     "x = 2, 4, 8, 16 prompts per GPU (groups of 8 responses) at max response 2K and 4K",
                     "records: seeded draws from the workload preset; 'observed' time = the closed-form model "
                     "under perturbed ground-truth parameters times the simulator's log-normal jitter (σ = 0.03); "
                     "calibration starts from the preset-derived parameters (bidirl.perf.fit)")))
    out.append(PanelSpec(
        id="stage-trainer", title="Stage-time model: trainer (M_t)", figure="Fig. eval-static (d)",
        kind="stage-model", base="a6000-default", hardware="a6000", variable="chunks per GPU",
        points=tuple(Point.of(f"{n}c@{k}K", (n, k * 1024), {"workload.max_response_len": k * 1024})
                     for k in (2, 4) for n in (1, 2, 4, 8)),
        policies=(), claims=("stage-trainer-median", "stage-trainer-p90"),
        quick_labels=tuple(f"{n}c@{k}K" for k in (2, 4) for n in (1, 2, 4, 8)),
        paper=("The trainer time increases with chunks per GPU; median error 2.92 %, p90 4.68 % (§7.4)."),
        assumptions=("Qwen3-VL-4B on Geo3K, A6000, one trainer replica per GPU, micro-batch 4 samples per device",
                     "x = 1, 2, 4, 8 chunks per GPU, each chunk one micro-batch per device, for each stage "
                     "(old_logprob, ref_logprob, actor_update) at max response 2K and 4K",
                     "records as for the rollout panel (σ = 0.03 jitter, the simulator's chunk-time jitter)")))
    return out


def all_specs() -> dict:
    """Every panel, keyed by id, in the paper's order."""
    specs = _e2e("a6000") + _e2e("h100") + _ablation() + _static()
    return {s.id: s for s in specs}


SPECS: dict = all_specs()


def get(panel_id: str, quick: bool = False) -> PanelSpec:
    """The spec ``panel_id`` (its CI-sized variant when ``quick``); unknown ids raise a ValueError naming them."""
    if panel_id not in SPECS:
        import difflib
        close = difflib.get_close_matches(panel_id, list(SPECS), n=3)
        hint = f"did you mean {', '.join(close)}?" if close else f"known panels: {', '.join(SPECS)}"
        raise ValueError(f"unknown panel {panel_id!r} — {hint}")
    spec = SPECS[panel_id]
    return spec.quick() if quick else spec


def select(only=None, quick: bool = False) -> list:
    """Specs to run: all, or those whose id equals or starts with one of ``only`` (e.g. ``e2e-a6000``)."""
    if not only:
        chosen = list(SPECS.values())
    else:
        chosen, seen = [], set()
        for key in only:
            hits = [s for s in SPECS.values() if s.id == key or s.id.startswith(key)]
            if not hits:
                get(key)  # raises with suggestions
            for s in hits:
                if s.id not in seen:
                    seen.add(s.id)
                    chosen.append(s)
    return [s.quick() if quick else s for s in chosen]


__all__ = ["Point", "PanelSpec", "SPECS", "all_specs", "get", "select", "E2E_POLICIES", "ABLATION_POLICIES",
           "STALENESS_VALUES", "MEASURED_STEPS", "QUICK_MEASURED_STEPS"]
