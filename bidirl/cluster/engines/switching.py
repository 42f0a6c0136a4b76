"""The engine backend's hot switch of a pool between its roles (paper §3.2).

Offload the passive role's state, onload the active one, and bring the active one's weights to the current version;
a rollouter switched in wakes its weights, loads the version, then wakes its KV cache (vLLM sleep level 2 and wake
by tags, trainer offload on GPU; on CPU the KV cache and the trainer's weights and optimizer state are really freed
and restored). The measured durations are C_in / C_out, fed back to the profiler through ``SwitchFinished``; each
phase's too (``costs``). An auxiliary gang's window is handed to the primary gang before the gang is offloaded
(:mod:`.gradient_windows`: C_grad, measured apart).
"""

from __future__ import annotations

from bidirl.core import protocol as P

PRIMARY_TRAINER, AUX_TRAINER = P.PRIMARY_TRAINER, P.AUX_TRAINER


class EngineSwitch:
    """The switches of one engine run (module doc). ``backend``: the
    :class:`~bidirl.cluster.engines.backend.EngineBackend`."""

    def __init__(self, backend):
        self.backend, self.pool = backend, backend.pool

    def switch(self, cmd: P.Switch):
        """Offload the pool's passive role, onload the active one and bring its weights to ``cmd.version`` (§3.2),
        in phases: ``offload`` (the passive role out), ``wake`` (a rollouter's weights, a gang's whole state),
        ``load`` (the version), ``kv`` (a rollouter's KV cache, once its weights are in place). Each phase's
        duration is measured as ``c_in.<phase>`` / ``c_out.<phase>`` beside the whole switch."""
        d = self.pool
        passive, active = d.switch_sides(cmd)
        start = d.now()
        which = "c_in" if cmd.phase == "in" else "c_out"
        waited = [0.0]       # seconds the load waited for a primary gang being restarted: not a switch's cost

        def calls(method, workers, **rollout_kwargs):
            out = []
            for w in d._alive(workers):
                if w in d.gangs:
                    out += [(w, getattr(r, method).remote()) for r in d.gangs[w]]
                else:
                    out.append((w, getattr(d.actors[w], method).remote(**rollout_kwargs)))
            return out

        def phase(name, pairs, then, applies=None):
            """Run a set of calls; a worker that dies meanwhile only drops out (the coordinator recovers). The
            phase is timed where it ``applies`` (default: it has calls; a load with nothing to load counts 0 s)."""
            if not (pairs if applies is None else applies):
                then()
                return
            t0 = d.now()

            def done(_values):
                d._measure((cmd.direction, f"{which}.{name}"), d.now() - t0)
                then()
            d._when_all(pairs, done, tolerate=True)

        def finish():
            end = d.now()
            d._measure((cmd.direction, which), end - start - waited[0])
            d.record_switch(cmd, start, end)
            d.feed(P.SwitchFinished(end, cmd.pool, cmd.to_role, end - start - waited[0]))

        def wake():
            phase("wake", calls("onload", active, kv=False), load)

        def load():
            # while the primary gang (the sender) is restarted and replays its steps, the load waits for it: that
            # wait is the failure's, and charging it to C_in would make the scheduler stop borrowing
            restarting, t0 = PRIMARY_TRAINER in d.failed or d.sync.publishing is not None, d.now()

            def loaded():
                if restarting:
                    waited[0] += d.now() - t0
                kv()
            phase("load", self.backend.loads.calls(active, cmd.version), loaded, applies=bool(active))

        def kv():
            phase("kv", calls("onload", [w for w in active if w not in d.gangs]), finish)

        def offload():
            nonlocal start
            start = d.now()               # C_out from here: the window's hand-over is C_grad, measured apart
            out = calls("offload", passive)
            self.backend.loads.forget_discarded(passive)
            phase("offload", out, wake)
        if AUX_TRAINER in passive and d.sync.collective:
            d.windows.send(offload)       # the window ends: its gradient goes to the primary gang first
        else:
            offload()
