"""MLflow export (controlplane/exports): a job that asks for it gets a run in one of the deployment's tracking
servers, read back here with mlflow.get_run from a local SQLite store; a URI of the user's own is refused."""
from __future__ import annotations

import json

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from controlplane.exports import receivers as export_receivers
from controlplane.exports import tasks as export_tasks
from controlplane.exports.mlflow_export import export_job
from controlplane.jobs.models import CollectionJob
from controlplane.jobs.services import mlflow_target
from tests.factories import api_token, ingest_dataset, make_endpoint, make_job, make_user, service_job


@pytest.fixture
def tracking(settings, tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    settings.MLFLOW_TRACKING_URIS = {"local": uri}
    settings.MLFLOW_EXPERIMENT_NAME = "rollouts-test"
    settings.MLFLOW_TABLE_ROWS = 10
    return uri


@pytest.mark.django_db
def test_only_the_deployments_tracking_servers_are_accepted(tracking, client):
    owner = make_user("ml")
    assert mlflow_target("local") == "local" and mlflow_target(tracking) == "local" and mlflow_target("") == ""
    for hostile in ("file:///etc", "sqlite:////tmp/mine.db", "http://169.254.169.254/", "LOCAL", tracking + "x", 5):
        with pytest.raises(ValidationError) as err:
            service_job(owner, mlflow_tracking_uri=hostile)
        assert "mlflow_tracking_uri" in err.value.message_dict
    job = service_job(owner, mlflow_tracking_uri=tracking)  # the exact URI names the server: the name is kept
    assert job.collection_options == {"mlflow": "local"}

    # the API: the same rule, the same stored name
    token = api_token(owner)
    ds, ep = ingest_dataset(owner, name="ml-api"), make_endpoint(owner, name="ml-api")
    body = {"dataset": ds.pk, "endpoint": ep.pk, "mlflow_tracking_uri": "file:///var/lib"}
    bad = client.post("/api/jobs/", json.dumps(body), content_type="application/json", HTTP_AUTHORIZATION=f"Token {token}")
    assert bad.status_code == 400 and "mlflow_tracking_uri" in bad.json()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("controlplane.jobs.services.dispatch_chunks", lambda *a, **k: [])
        ok = client.post("/api/jobs/", json.dumps({**body, "mlflow_tracking_uri": "local"}),
                         content_type="application/json", HTTP_AUTHORIZATION=f"Token {token}")
    assert ok.status_code == 201, ok.content
    assert CollectionJob.objects.get(pk=ok.json()["id"]).collection_options == {"mlflow": "local"}


@pytest.mark.slow
@pytest.mark.django_db
def test_job_run_read_back_with_get_run(tracking, monkeypatch, tmp_path):
    import mlflow
    from mlflow.tracking import MlflowClient

    owner = make_user("mlrun")
    job = make_job(owner, ingest_dataset(owner), make_endpoint(owner), n_rollouts=40, fail_every=10, name="math-40")
    job.collection_options = {"mlflow": "local"}
    job.aggregate_metrics = {"mean/reward": 0.5, "pass@1": {"all": 0.5}, "note": "text is not a metric"}
    job.save(update_fields=["collection_options", "aggregate_metrics"])

    # the job's end queues the export (a notice listener), which writes the run once
    queued = []
    monkeypatch.setattr(export_tasks.export_job_task, "delay", queued.append)
    export_receivers.on_notice("job.completed", {"job_id": job.pk})
    assert queued == [job.pk]
    out = export_tasks.export_job_task(job.pk)
    run_id = out["mlflow_run_id"]
    assert run_id
    job.refresh_from_db()
    assert job.collection_options["mlflow_run_id"] == run_id and export_job(job) == run_id  # not exported twice
    export_receivers.on_notice("job.completed", {"job_id": job.pk})
    assert queued == [job.pk]

    mlflow.set_tracking_uri(tracking)
    run = mlflow.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == f"job {job.pk} math-40"
    assert run.data.tags["rollouts.job_id"] == str(job.pk)
    assert run.data.params["verifier"] == job.verifier and run.data.params["num_repeats"] == "1"
    m = run.data.metrics  # keys in MLflow's alphabet ("pass@1" -> "pass_1")
    assert m["aggregate.mean/reward"] == 0.5 and m["aggregate.pass_1.all"] == 0.5 and "aggregate.note" not in m
    assert m["job.ok"] == 36 and m["job.failed"] == 4 and m["job.output_tokens"] == 40 * 9  # every stored row's tokens
    c = MlflowClient(tracking_uri=tracking)
    sps = c.get_metric_history(run_id, "samples_per_s")  # one point per second of the job, as stored
    assert [p.value for p in sps] == [10.0, 11.0, 12.0, 13.0, 14.0] and [p.step for p in sps] == sorted(p.step for p in sps)
    assert [p.value for p in c.get_metric_history(run_id, "errors")] == [0, 1, 0, 1, 0]
    assert [p.value for p in c.get_metric_history(run_id, "reward")] == [16 / 36]  # all stored in one second
    assert {a.path for a in c.list_artifacts(run_id)} == {"diagnosis.json", "rollouts_sample.json"}
    assert run.info.artifact_uri.startswith((tmp_path / "mlflow-artifacts").as_uri())  # beside the store, not ./mlruns
    table = json.loads(open(c.download_artifacts(run_id, "rollouts_sample.json")).read())
    assert len(table["data"]) == 10 and table["columns"][:3] == ["task_index", "rollout_index", "status"]
    assert [row[0] for row in table["data"]] == [0, 4, 8, 12, 16, 20, 24, 28, 32, 36]  # spread over the job
    assert "boxed" in table["data"][0][-1]
    diag = json.loads(open(c.download_artifacts(run_id, "diagnosis.json")).read())
    assert diag["job"] == job.pk and "diagnosis" in diag


@pytest.mark.django_db
def test_the_job_form_offers_the_configured_servers_by_name(tracking, client, settings, monkeypatch):
    from controlplane.dashboard.forms import LaunchJobForm

    owner = make_user("ml-form")
    ds, ep = ingest_dataset(owner, name="ml-form"), make_endpoint(owner, name="ml-form")
    client.force_login(owner)
    page = client.get(f"/datasets/{ds.pk}/").content.decode()
    assert 'name="mlflow_tracking_uri"' in page and ">local</option>" in page and tracking not in page  # names only
    monkeypatch.setattr("controlplane.jobs.services.dispatch_chunks", lambda *a, **k: [])
    post = {"endpoint": ep.pk, "num_repeats": 1, "num_samples_in_parallel": 4, "verifier": "math",
            "verify_mode": "inline", "verify_cache": "job", "chunk_size": 100}
    assert client.post(f"/datasets/{ds.pk}/", {**post, "mlflow_tracking_uri": tracking}).status_code == 400  # not a choice
    assert not CollectionJob.objects.filter(owner=owner).exists()
    assert client.post(f"/datasets/{ds.pk}/", {**post, "mlflow_tracking_uri": "local"}).status_code == 302
    assert CollectionJob.objects.get(owner=owner).collection_options == {"mlflow": "local"}
    settings.MLFLOW_TRACKING_URIS = {}
    assert "mlflow_tracking_uri" not in LaunchJobForm().fields  # nothing configured: no field


def test_rolloutctl_run_sends_the_mlflow_option_only_when_given():
    from rolloutctl.cli import build_parser, do_submit

    class Client:
        def create_job(self, body, idempotency_key=None):
            self.body = body
            return {"id": 9, "progress": {"total": 1}}, True

    c = Client()
    do_submit(c, build_parser().parse_args(["run", "--dataset-id", "1", "--endpoint", "2", "--mlflow", "team"]))
    assert c.body["mlflow_tracking_uri"] == "team"
    do_submit(c, build_parser().parse_args(["run", "--dataset-id", "1", "--endpoint", "2"]))
    assert "mlflow_tracking_uri" not in c.body


@pytest.mark.django_db
def test_series_go_to_mlflow_while_the_job_runs_each_second_once(tracking):
    from mlflow.tracking import MlflowClient

    from controlplane.exports.mlflow_export import FINAL, LIVE, RUN_ID, _move_cursor, live_tick
    from controlplane.jobs.models import JobMetricSample, Rollout
    from controlplane.lanes import is_control

    owner = make_user("ml-live")
    job = make_job(owner, ingest_dataset(owner), make_endpoint(owner), n_rollouts=40, state="running", name="live")
    job.collection_options = {"mlflow": "local"}
    job.save(update_fields=["collection_options"])
    t0 = job.started_at
    JobMetricSample.objects.filter(job=job).delete()
    for sec in range(20):  # one sample per second of the job, samples/s = its second
        JobMetricSample.objects.create(job=job, worker="w1", t=t0 + timezone.timedelta(seconds=sec + 0.5),
                                       samples_per_s=float(sec), output_tokens_per_s=9.0 * sec)
    for r in Rollout.objects.filter(job=job):  # rollout i stored in second i % 20
        Rollout.objects.filter(pk=r.pk).update(created_at=t0 + timezone.timedelta(seconds=r.task_index % 20 + 0.25))
    c = MlflowClient(tracking_uri=tracking)

    def history(name):
        return [(p.step, p.value) for p in sorted(c.get_metric_history(run_id, name), key=lambda p: p.step)]

    # 12.5 s into the job, lag 5 s: seconds 0-6 are written, the run is open
    assert live_tick(now=t0 + timezone.timedelta(seconds=12.5)) == {"jobs": 1, "points": 7 * 5}  # 4 series + reward
    run_id = CollectionJob.objects.get(pk=job.pk).collection_options[LIVE]["run_id"]
    assert c.get_run(run_id).info.status == "RUNNING"
    assert history("samples_per_s") == [(s, float(s)) for s in range(7)]
    assert live_tick(now=t0 + timezone.timedelta(seconds=12.9))["points"] == 0  # nothing new: nothing written twice
    assert _move_cursor(job.pk, 5) is None  # a late writer cannot move the cursor back
    assert live_tick(now=t0 + timezone.timedelta(seconds=20))["points"] == 8 * 5  # seconds 7-14
    assert history("output_tokens_per_s") == [(s, 9.0 * s) for s in range(15)]
    # the beat (control lane) only queues a tick per live job; the tick, which calls the tracker, is a work task
    queued = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(export_tasks.mlflow_live_job_task, "delay", queued.append)
        assert export_tasks.mlflow_live_task() == 1 and queued == [job.pk]
    assert not is_control("controlplane.exports.tasks.mlflow_live_job_task")

    # the job ends: the rest of the series, the aggregates, the run closed; each second exactly once
    CollectionJob.objects.filter(pk=job.pk).update(state="completed", finished_at=t0 + timezone.timedelta(seconds=21))
    out = export_tasks.export_job_task(job.pk)
    assert out["mlflow_run_id"] == run_id
    assert history("samples_per_s") == [(s, float(s)) for s in range(20)]
    rewards = history("reward")
    assert [s for s, _ in rewards] == list(range(20))
    stored = {s: [float(i % 2) for i in range(40) if i % 20 == s] for s in range(20)}  # make_job: reward i % 2
    assert rewards == [(s, sum(v) / len(v)) for s, v in stored.items()]
    run = c.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.metrics["job.ok"] == 40 and run.data.tags["rollouts.state"] == "completed"
    opts = CollectionJob.objects.get(pk=job.pk).collection_options
    assert opts == {"mlflow": "local", RUN_ID: run_id}
    assert live_tick(now=t0 + timezone.timedelta(seconds=40)) == {"jobs": 0, "points": 0}  # ended: left alone
    assert _move_cursor(job.pk, FINAL) is None
    assert len(c.search_runs([c.get_run(run_id).info.experiment_id])) == 1  # one run for the job
    assert is_control("controlplane.exports.tasks.mlflow_live_task")  # a beat task: on the control lane


@pytest.mark.django_db
def test_live_tick_costs_nothing_without_a_tracking_server(settings, django_assert_num_queries):
    from controlplane.exports.mlflow_export import live_tick

    settings.MLFLOW_TRACKING_URIS = {}
    with django_assert_num_queries(0):
        assert live_tick() == {"jobs": 0, "points": 0}
