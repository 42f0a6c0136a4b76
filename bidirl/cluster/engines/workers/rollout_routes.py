"""The rollouter's half of Rollout Routing Replay (R3, docs/architecture.md "MoE"): each request's expert routes,
position by position, as vLLM's worker computed them.

vLLM batches the scheduled tokens of all running requests into one forward per engine step, in the order of its
input batch (``input_batch.req_ids``, each request contributing ``scheduler_output.num_scheduled_tokens[id]``
consecutive tokens; ``GPUModelRunner._prepare_inputs``), and hands the forward each token's position. A
:class:`StepRouteCapture` installed in the worker (the CPU build's in-process worker, through ``collective_rpc``):

* hooks every MoE router (:func:`bidirl.rl.routes.install_route_hooks`), so one forward's rows are the batch's
  tokens in that order, one ``(layers, k)`` row each;
* wraps ``execute_model`` to see the step's scheduled token counts, and ``_model_forward`` to see the positions and
  split the forward's rows by request.

A request keeps ``position → row``: a request vLLM preempts and recomputes overwrites its rows with the same
positions' new ones, so a row is always the route of the last forward that computed that position. Positions vLLM
serves from its prefix cache never reach a router; the engine fills them from
:class:`bidirl.rl.routes.PrefixRoutes`. vLLM names a request internally ``<the caller's id>-<8 characters>``
(``InputProcessor.assign_request_id``); :meth:`StepRouteCapture.take` answers by the caller's id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bidirl.rl.routes import ROUTE_DTYPE, RouteRecorder, install_route_hooks


@dataclass
class StepRouteCapture:
    """Per request (vLLM's internal id), ``position → (layers, k)`` routes of every token a forward computed."""
    recorder: RouteRecorder
    rows: dict = field(default_factory=dict)
    scheduled: Any = None              # the running step's {request id: tokens scheduled}; None outside a step
    forwards: int = 0                  # engine-step forwards split by request (dummy and warm-up runs excluded)

    def take(self, request_id: str) -> dict:
        """Remove and return the rows of the request the caller named ``request_id`` (``{}`` if it computed none)."""
        out: dict = {}
        for rid in [r for r in self.rows if r == request_id or r.startswith(request_id + "-")]:
            out.update(self.rows.pop(rid))
        return out

    def split(self, req_ids, positions) -> None:
        """Give each request of the forward just run its rows (called after the forward, inside the step)."""
        counts = [int(self.scheduled.get(rid, 0)) for rid in req_ids]
        total = sum(counts)
        routes = self.recorder.routes()
        self.recorder.clear()
        if len(routes) < total:
            raise RuntimeError(f"route capture: the forward's routers saw {len(routes)} tokens, the step scheduled "
                               f"{total}")
        pos = np.asarray(positions[:total].detach().cpu().numpy(), dtype=np.int64)
        rows = routes[:total].astype(ROUTE_DTYPE, copy=False)     # rows past ``total`` pad a CUDA-graph batch
        start = 0
        for rid, n in zip(req_ids, counts):
            if n:
                own = self.rows.setdefault(rid, {})
                for p, row in zip(pos[start:start + n], rows[start:start + n]):
                    own[int(p)] = row
            start += n
        self.forwards += 1


def install_step_capture(worker, top_k: int) -> StepRouteCapture:
    """Install a :class:`StepRouteCapture` on ``worker``'s model runner (run inside vLLM's worker through
    ``LLM.collective_rpc``; in-process, the returned object is the one the hooks fill)."""
    runner = worker.model_runner
    capture = StepRouteCapture(install_route_hooks(runner.model, top_k))
    execute, forward = runner.execute_model, runner._model_forward

    def execute_model(scheduler_output, *args, **kwargs):
        capture.scheduled = scheduler_output.num_scheduled_tokens
        try:
            return execute(scheduler_output, *args, **kwargs)
        finally:
            capture.scheduled = None

    def model_forward(*args, **kwargs):
        capture.recorder.clear()
        out = forward(*args, **kwargs)
        if capture.scheduled is None:              # a dummy or profiling run: no request's tokens
            capture.recorder.clear()
        else:
            batch = runner.input_batch
            capture.split(list(batch.req_ids[:batch.num_reqs]), kwargs["positions"])
        return out

    runner.execute_model = execute_model
    runner._model_forward = model_forward
    return capture


class RolloutRoutes:
    """The route half of :class:`~bidirl.cluster.engines.workers.rollout.RolloutEngine` (a mixin; its ``route_shape``,
    ``gpu``, ``llm``, ``kv_block_tokens``, ``version`` and ``_groups``): each response's ``position → row`` routes,
    assembled from its requests' rows, a resumed prefix's rows and the kept prefix blocks."""

    @staticmethod
    def route_shape_of(config) -> tuple:
        """``(MoE layers, k)`` of the checkpoint's config; ValueError for a dense model (no routes to record)."""
        from bidirl.rl.routes import moe_route_shape
        try:
            return moe_route_shape(config)
        except ValueError as exc:
            raise ValueError(f"RolloutEngine.routes: {exc}; record routes only for an MoE model") from None

    def _start_route_capture(self) -> None:
        """Once the vLLM engine is built: the kept prefix blocks and, on CPU, the worker's capture."""
        self._route_capture = self._prefix_routes = None
        if self.route_shape is None:
            return
        from bidirl.rl.routes import PrefixRoutes

        self._prefix_routes = PrefixRoutes(block=self.kv_block_tokens)
        self._prefix_routes_version = None
        if not self.gpu:           # vLLM's CPU build refuses enable_return_routed_experts: hook the routers
            top_k = self.route_shape[1]
            self._route_capture = self.llm.collective_rpc(lambda w: install_step_capture(w, top_k))[0]

    def _take_routes(self, gid: int, resp, request_id: str, completion) -> None:
        """Add the routes of ``request_id``'s computed positions to ``resp`` (the rows it already holds — a resumed
        prefix's — win), then the prefix-cache-served positions from :attr:`_prefix_routes`; keep its full blocks."""
        if self.route_shape is None:
            return
        if self._route_capture is not None:
            new = self._route_capture.take(request_id)
        else:                       # GPU: vLLM's own record (enable_return_routed_experts), positions 0 … n − 1
            from bidirl.rl.routes import as_routes

            got = getattr(completion, "routed_experts", None) if completion is not None else None
            new = {} if got is None else dict(enumerate(as_routes(got, *self.route_shape, f"request {request_id}")))
        for p, row in new.items():
            resp.routes.setdefault(p, row)
        if self._prefix_routes_version != self.version:     # blocks of older weights: the prefix cache was reset
            self._prefix_routes.clear()
            self._prefix_routes_version = self.version
        tokens = list(self._groups[gid].request.prompt_ids) + list(resp.tokens)
        self._prefix_routes.fill(tokens, resp.routes, upto=len(tokens) - 1)
        self._prefix_routes.store(tokens, resp.routes)

    def _routes_of(self, req, resp):
        """A response's routes: one row per token its model was fed (the prompt and every response token but the
        last, which is sampled and never fed back) — all of them once it is done; the leading positions known so
        far while it is unfinished (a prefix that a resume continues)."""
        from bidirl.rl.routes import sequence_routes

        n = len(req.prompt_ids) + len(resp.tokens) - 1
        if not resp.done:
            n = next((p for p in range(n) if p not in resp.routes), n)
        if n <= 0:
            return np.zeros((0,) + self.route_shape, dtype=ROUTE_DTYPE)
        return sequence_routes(resp.routes, n, f"RolloutEngine: group {req.group_id}")

