"""What runs inside the Ray workers' processes of an engine run (paper §2.1, §5): the engines and their actors.

``actors`` (the Ray actors: one engine each, every call a timed span), ``rollout`` (the interruptible vLLM engine),
``sampler`` (position-keyed sampling), ``trainer`` (the torch trainer engine, one module per concern),
``logprob`` (response log-probs without full logits), ``host_buffer`` (a hot switch's host buffer),
``state_copy`` (the recovery snapshot's copy to host memory, beside the next chunks),
``snapshot_files`` (a rank's recovery snapshots on its node's disk), ``weight_transport`` (weights in buckets over
``torch.distributed``), ``launch_order`` (one order for a gang rank's collectives on its two threads) and
``bridge`` (auxiliary gradient windows shard to shard).

Nothing here imports the driver's side (:mod:`bidirl.cluster.engines`' other modules, :mod:`bidirl.cluster.pool`,
the job's configuration): a worker's process loads only what it runs (``tests/test_architecture.py``).
"""
