"""Every metrics record carries the process's CPU seconds, counting all its threads (vLLM's
engine runs in threads of the actor process); the learning benchmark adds them up per version."""

import threading
import time

from pipeline_rl.config import RunConfig
from pipeline_rl.metrics import MetricsLogger, read_metrics


def test_cpu_seconds_count_the_work_of_other_threads(tmp_path):
    cfg = RunConfig()
    cfg.run_dir = str(tmp_path)
    cfg.metrics.tensorboard = False
    logger = MetricsLogger(cfg, "actor0")
    logger.log({"step": 0})
    spent = []

    def spin():
        start = time.thread_time()
        while time.thread_time() - start < 0.3:
            pass
        spent.append(time.thread_time() - start)

    worker = threading.Thread(target=spin)
    worker.start()
    worker.join()
    logger.log({"step": 1})
    logger.close()
    first, second = (r["values"] for r in read_metrics(tmp_path))
    # The spinning thread's own CPU time is part of the process's; the main thread only waited.
    assert second["cpu_s"] - first["cpu_s"] >= spent[0]
