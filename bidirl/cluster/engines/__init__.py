"""Real engines under the coordinator: vLLM rollout replicas and torch trainer gangs on Ray.

Two sides, one per process:

* the **driver's side** (this folder, in the driver's process): ``driver`` (:class:`EngineDriver`: the pool driver
  with the engines plugged in; the run's settings, prompts and reward); ``backend`` (:class:`EngineBackend`, the
  engines' :class:`~bidirl.cluster.backend.WorkerBackend`), which turns the coordinator's commands into actor calls
  through one module per concern: ``placement`` (start-up, kept workers, a lost worker's restart), ``rollouts``
  (generation), ``training`` (a step's data in ``step_data``, chunks, merge, optimizer step), ``weight_loads`` (the
  version each worker holds, its loads) and ``switching`` (the hot switch); ``weight_sync`` and
  ``gradient_windows`` (transfers the driver arranges), ``trainer_recovery`` (getting a lost primary gang back),
  ``rollout_setup`` (rollouters' settings from the plan), ``object_store_meter`` (bytes through Ray) and
  ``sync_grpo`` (a synchronous GRPO loop without Ray);
* the **workers' side** (:mod:`bidirl.cluster.engines.workers`, inside the Ray workers' processes): the Ray actors,
  the vLLM rollout engine, the torch trainer engine (one module per concern) and the transports between them.

The driver's side imports the workers' side (descriptors, shares), never the other way round. Imported lazily:
these modules need Ray, vLLM and torch.
"""
