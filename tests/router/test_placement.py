"""Workers Ray could never place are refused before any actor exists, with what they
need and what the nodes have (pure: no Ray)."""
from pdserve.router.pool.placement import unplaceable, until_placeable

ONE_CPU = {"CPU": 1.0}


def test_three_one_cpu_workers_do_not_fit_two_cpus():
    reason = unplaceable({"prefill-0": ONE_CPU, "decode-0": ONE_CPU, "decode-1": ONE_CPU},
                         [{"CPU": 2.0, "memory": 1e10}])
    assert reason is not None
    assert "3 workers need 3 CPU" in reason and "have 2 CPU" in reason
    assert "--num-cpus-per-worker" in reason


def test_workers_that_fit_on_some_node_each():
    workers = {"p": {"CPU": 1.0, "GPU": 1.0}, "d0": {"CPU": 1.0, "GPU": 1.0},
               "d1": {"CPU": 1.0, "GPU": 1.0}}
    assert unplaceable(workers, [{"CPU": 8.0, "GPU": 2.0}, {"CPU": 8.0, "GPU": 1.0}]) is None


def test_a_total_that_suffices_is_not_enough_when_no_node_holds_one_worker():
    reason = unplaceable({"p": {"GPU": 2.0}}, [{"GPU": 1.0}, {"GPU": 1.0}])
    assert reason is not None and "p (2 GPU)" in reason


def test_a_custom_resource_no_node_has():
    reason = unplaceable({"d0": {"CPU": 1.0, "decode_node": 1.0}}, [{"CPU": 4.0}])
    assert reason is not None and "decode_node" in reason


def test_nodes_still_joining_get_until_the_timeout_and_the_reason_is_the_last_one():
    """A `ray up` or autoscaled cluster: the head is up before the nodes the workers
    need. The check is read again until they join, or the time is out."""
    joined = [[], [{"CPU": 4.0}], [{"CPU": 4.0}, {"CPU": 4.0, "decode": 1.0}]]
    reads, now = iter(joined), [0.0]
    workers = {"prefill-0": ONE_CPU, "decode-0": {"CPU": 1.0, "decode": 1.0}}

    def sleep(seconds):
        now[0] += seconds

    assert until_placeable(workers, lambda: next(reads), timeout_s=10, every_s=1,
                           clock=lambda: now[0], sleep=sleep) is None
    assert now[0] == 2.0
    never = until_placeable(workers, lambda: [{"CPU": 4.0}], timeout_s=10, every_s=1,
                            clock=lambda: now[0], sleep=sleep)
    assert "decode-0" in never and now[0] == 12.0
    assert until_placeable(workers, lambda: [], timeout_s=0, clock=lambda: now[0],
                           sleep=sleep).startswith("Ray cannot place")
