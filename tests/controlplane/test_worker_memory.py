"""A worker runs one event loop per chunk: each must be freed when its run returns, not left to a full garbage
collection (which a worker's large heap makes rare): uvloop's loop holds ~256 KB, and a worker grew by that much a
chunk while the loops of the chunks it had run waited in reference cycles."""
import asyncio
import gc
import weakref

import pytest

from controlplane.jobs import services
from controlplane.jobs.runtime import run_chunk


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
def test_a_chunk_run_frees_its_event_loop_without_a_collection(event_loop, monkeypatch, user, math_dataset,
                                                               sim_endpoint, simulator_factory):
    monkeypatch.setenv("ENGINE_EVENT_LOOP", event_loop)
    sim = simulator_factory(ttft_ms=1, itl_ms=0, max_num_seqs=64)
    job = services.create_job(owner=user, dataset=math_dataset(40), endpoint=sim_endpoint(sim.url, model=sim.model),
                              num_samples_in_parallel=8, chunk_size=20, verifier="exact", launch=False,
                              responses_create_params={"max_output_tokens": 8})
    loops = []

    def on_progress(message):  # called on the run's loop, as each progress message goes out
        loop = asyncio.get_running_loop()
        if not any(ref() is loop for ref in loops):
            loops.append(weakref.ref(loop))

    gc.collect()
    gc.disable()
    try:
        for chunk in job.chunks.order_by("index"):
            run_chunk(chunk.pk, worker_name="memory", redispatch=False, on_progress=on_progress)
        alive = [ref() for ref in loops]
    finally:
        gc.enable()
    job.refresh_from_db()
    assert job.state == "completed", job.error_message
    assert len(loops) == 2, "each chunk's run was seen on its own loop"
    # the job's progress messages went through the channel layer (which wraps each loop's close), so the test
    # covers the cycle that held the loops
    assert [loop for loop in alive if loop is not None] == []
