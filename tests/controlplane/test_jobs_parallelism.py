"""num_samples_in_parallel is the job's total in-flight budget, however many chunks run at once."""
import threading

import pytest

from controlplane.jobs import services
from controlplane.jobs.models import JobChunk
from controlplane.jobs.runtime import run_chunk
from controlplane.jobs.sink import chunk_parallelism_share


@pytest.mark.django_db
def test_running_chunks_share_the_job_budget(user, math_dataset, sim_endpoint):
    job = services.create_job(owner=user, dataset=math_dataset(40), endpoint=sim_endpoint("http://127.0.0.1:9"),
                              num_samples_in_parallel=10, chunk_size=10, launch=False)
    chunks = list(job.chunks.order_by("index"))
    assert len(chunks) == 4
    # Alone, a chunk gets the whole budget.
    assert chunk_parallelism_share(job.pk, chunks[0].pk, 10) == 10
    # Starting, it counts the chunks not yet running too: chunks started together cannot see each other yet.
    assert chunk_parallelism_share(job.pk, chunks[0].pk, 10, starting=True) == 3
    # Three running: 4 + 3 + 3, never more than the budget in total.
    JobChunk.objects.filter(pk__in=[c.pk for c in chunks[:3]]).update(state=JobChunk.State.RUNNING)
    shares = [chunk_parallelism_share(job.pk, c.pk, 10) for c in chunks[:3]]
    assert shares == [4, 3, 3] and sum(shares) == 10
    # A budget smaller than the number of chunks still lets each make progress.
    assert [chunk_parallelism_share(job.pk, c.pk, 2) for c in chunks[:3]] == [1, 1, 1]


@pytest.mark.django_db
def test_a_starting_chunk_counts_only_the_chunks_that_can_start_with_it(user, math_dataset, sim_endpoint):
    job = services.create_job(owner=user, dataset=math_dataset(40), endpoint=sim_endpoint("http://127.0.0.1:9"),
                              num_samples_in_parallel=12, chunk_size=5, launch=False)
    first = job.chunks.order_by("index").first()
    assert job.chunks.count() == 8
    # Run by one process (the command alone): no other chunk starts meanwhile, the whole budget.
    assert chunk_parallelism_share(job.pk, first.pk, 12, starting=True, peers=1) == 12
    # Three processes (or worker slots) may start three chunks together: a third each.
    assert chunk_parallelism_share(job.pk, first.pk, 12, starting=True, peers=3) == 4
    # Unknown (no worker registry): every open chunk may be starting, as before.
    assert chunk_parallelism_share(job.pk, first.pk, 12, starting=True) == 2  # 12 // 8, the first of the rest
    assert chunk_parallelism_share(job.pk, first.pk, 12, starting=True, peers=20) == 2


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_command_runs_each_chunk_at_the_whole_parallelism(simulator_factory, tmp_path):
    """The command alone runs a job of many chunks one after the other: each starts at the job's parallelism,
    not at a share counting the chunks still to come (a 30k-row file's six chunks started at 1/6, 1/5 ...
    of it for a second each: 5 % of the command's time at 200 ms latency)."""
    import json
    import statistics

    from django.core.management import call_command

    sim = simulator_factory(ttft_ms=200, itl_ms=0, max_num_seqs=256)
    inp = tmp_path / "tasks.jsonl"
    inp.write_text("".join(json.dumps({"responses_create_params": {"input": [{"role": "user", "content": f"{i}+1?"}]},
                                       "expected_answer": str(i + 1)}) + "\n" for i in range(96)))
    running, stop = [], threading.Event()

    def watch():
        import re
        while not stop.is_set():
            m = re.search(r"^vllm:num_requests_running\{[^}]*\} ([0-9.]+)", sim.metrics_text(), re.M)
            running.append(float(m.group(1)) if m else 0.0)
            stop.wait(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        call_command("collect_rollouts", f"+input_jsonl_fpath={inp}", f"+output_jsonl_fpath={tmp_path}/out.jsonl",
                     f"+model_base_url={sim.url}/v1", f"+model_name={sim.model}", "+num_samples_in_parallel=12",
                     "+chunk_size=24", "+verifier=exact", "+responses_create_params.max_output_tokens=8")
    finally:
        stop.set()
        watcher.join()
    job = JobChunk.objects.first().job
    assert job.state == "completed" and job.completed_count == 96 and job.chunks.count() == 4
    busy = [r for r in running if r > 0]
    # 4 chunks of 2 rounds of 12: the server holds 12 but for the ends of rounds; started at a share of the
    # chunks to come (3, 4, 6, 12 for the first second of each), the median was 4-6
    assert len(busy) > 20 and statistics.median(busy) >= 10, sorted(busy)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_concurrent_chunks_never_exceed_the_job_parallelism(user, math_dataset, sim_endpoint, simulator_factory):
    sim = simulator_factory(ttft_ms=30, itl_ms=2, max_num_seqs=256)
    job = services.create_job(owner=user, dataset=math_dataset(360), endpoint=sim_endpoint(sim.url, model=sim.model),
                              num_samples_in_parallel=8, chunk_size=120, verifier="exact", launch=False,
                              responses_create_params={"max_output_tokens": 24})
    peaks = []
    stop = threading.Event()

    def watch():  # the server's own count of requests it is generating
        import re
        while not stop.is_set():
            m = re.search(r"^vllm:num_requests_running\{[^}]*\} ([0-9.]+)", sim.metrics_text(), re.M)
            peaks.append(float(m.group(1)) if m else 0.0)
            stop.wait(0.05)

    from django.db import connection

    def run(chunk_id):
        try:
            run_chunk(chunk_id, worker_name=f"t{chunk_id}", redispatch=False)
        finally:
            connection.close()

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=run, args=(c.pk,)) for c in job.chunks.all()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    stop.set()
    watcher.join()
    job.refresh_from_db()
    assert job.state == "completed", job.error_message
    assert job.completed_count == 360
    # Three chunks ran at once; together they stayed within the job's budget of 8. A chunk may
    # overshoot by its in-flight requests for one control poll after a neighbour starts.
    assert max(peaks) > 3, "the chunks did not overlap; the test proves nothing"
    assert max(peaks) <= 8 + 3, peaks
    # Each chunk run writes its own metric series; the diagnosis adds the overlapping ones back up to
    # the job's budget instead of reading one chunk's share as the job's parallelism.
    from controlplane.diagnostics.services import job_ticks
    from controlplane.jobs.models import JobMetricSample
    from workers.diagnosis import build_evidence

    series = set(JobMetricSample.objects.filter(job=job).values_list("worker", flat=True))
    assert {f"t{c.pk} chunk {c.index}" for c in job.chunks.all()} <= series
    ev = build_evidence(job_ticks(job), config={"parallelism": 8})
    assert 5 < ev.parallelism <= 9.5, ev.parallelism  # one chunk's share would read 2-4
