"""launch refuses, at once and saying why, workers Ray could never place (it used to
wait silently for its whole startup timeout), and creates no actor."""
import time

import pytest
import ray

from pdserve.engine.config import EngineConfig
from pdserve.router.config import PoolSpec, RouterConfig
from pdserve.router.launch import launch
from pdserve.router.pool.placement import PlacementError


def test_workers_the_cluster_cannot_hold_fail_fast(ray_local, llama_dir):
    free_before = ray.available_resources().get("CPU", 0)
    t0 = time.monotonic()
    with pytest.raises(PlacementError) as err:  # 3 workers x 4 CPUs on 8 CPUs
        launch(EngineConfig.from_kwargs(str(llama_dir)),
               PoolSpec(1, 2, num_cpus_per_worker=4.0), router_config=RouterConfig())
    assert time.monotonic() - t0 < 30  # not the 600 s startup timeout
    assert "3 workers need 12 CPU" in str(err.value) and "8 CPU" in str(err.value)
    assert ray.available_resources().get("CPU", 0) == free_before  # no actor holds any
