"""Record the Ray timeline of a real bidirl CPU run beside bidirl's own event log of the same run.

    .venv/bin/python benchmarks/record_ray_timeline.py [STEPS]

writes ``tiny-cpu.ray-timeline.json`` (``ray.timeline``), ``tiny-cpu.events.parquet`` (the run's EventLog) and
``tiny-cpu.meta.json`` (the run's clock origin in Unix seconds, so both timelines share one clock) to
``data/traces/``. The
test ``tests/test_trace_import.py`` and notebook ``08-your-run`` read them; nothing re-records them in CI.
"""

import json
import sys
import time
from pathlib import Path

import ray

from bidirl.cluster.engines.driver import EngineDriver
from bidirl.job import config as cfgmod

HERE = Path(__file__).resolve().parents[1] / "data" / "traces"


def main(steps: int = 4) -> None:
    cfg = cfgmod.load("tiny-cpu")
    driver = EngineDriver(cfg, "bidirl", steps, cfg.seed)
    result = driver.run(progress=True)
    time.sleep(5)        # workers report task events once a second (RAY_task_events_report_interval_ms): let the
    ray.timeline(filename=str(HERE / "tiny-cpu.ray-timeline.json"))      # last step's events arrive first
    result.log.save(HERE / "tiny-cpu.events.parquet")
    meta = {"config": "tiny-cpu", "policy": "bidirl", "steps": steps, "seed": cfg.seed,
            "clock_origin_unix_s": driver.t0, "ray": ray.__version__,
            "pool_gpus": {p: int(n) for p, n in driver.assembly.pool_gpus.items()}}
    (HERE / "tiny-cpu.meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(json.dumps(result.summary()["idle"] if "idle" in result.summary() else result.summary(), default=str)[:2000])


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
