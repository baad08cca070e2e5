"""A hostile user names a module as a verifier: `?verifier=unittest.__main__:x` on a dataset upload imported
it in the web process and stopped the server. Users name registered verifiers (built-ins, VERIFIER_PLUGINS,
entry points) and dotted paths only into the operator's VERIFIER_PATH_MODULES: everywhere a verifier is
named (upload API and form, job creation API and form, the verify endpoint) a module path is a 400 and
nothing is imported; relative paths and malformed names are 400s, never 500s. The operator's manage.py
commands (load_dataset, collect_rollouts, verify_job) keep dotted paths: whoever runs them already runs
code on the host with the deployment's credentials.

The canary module writes a file when it is imported: the proof that nothing was imported."""
from __future__ import annotations

import io
import json
import sys
import uuid

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.core.management import call_command

from controlplane.datasets.models import Dataset
from controlplane.jobs.models import CollectionJob, VerificationRun

from .conftest import make_dataset, make_endpoint

ROW = json.dumps({"responses_create_params": {"input": "What is 1 + 1?"}, "expected_answer": "2"}) + "\n"
MALFORMED = [".canary:x", "..x:y", "a..b:c", "x:", ":x", "mod:x y", "mod:x\x00", "é.x:y", "a" * 300]


@pytest.fixture
def canary(tmp_path, monkeypatch):
    """A module on sys.path that leaves a marker file when imported, with a valid verifier in it."""
    name = f"canary_{uuid.uuid4().hex[:10]}"
    marker = tmp_path / "imported"
    (tmp_path / f"{name}.py").write_text(
        f"open({str(marker)!r}, 'w').write('imported')\n"
        "from workers.verifiers import verifier\n\n"
        "@verifier(required_fields=(), kind='cpu')\n"
        "def x(row, response_text, options):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name, marker
    sys.modules.pop(name, None)


def _not_imported(canary):
    name, marker = canary
    return not marker.exists() and name not in sys.modules


def test_dataset_upload_api_and_form_refuse_a_module_path(api, web, canary):
    name, _ = canary
    for verifier in (f"{name}:x", f"{name}.x", "unittest.__main__:x"):
        r = api.post(f"/api/datasets/?verifier={verifier}", ROW, content_type="application/x-ndjson")
        assert r.status_code == 400 and "verifier" in r.json(), (verifier, r.content)
        r = api.post("/api/datasets/", {"file": SimpleUploadedFile("t.jsonl", ROW.encode()), "verifier": verifier},
                     format="multipart")
        assert r.status_code == 400 and "verifier" in r.json(), (verifier, r.content)
        r = web.post("/datasets/upload/", {"file": SimpleUploadedFile("t.jsonl", ROW.encode()), "verifier": verifier})
        assert r.status_code == 400 and "only the operator" in r.content.decode(), verifier
    assert _not_imported(canary) and "unittest.__main__" not in sys.modules
    assert not Dataset.objects.exists()


@pytest.mark.parametrize("verifier", MALFORMED)
def test_relative_and_malformed_names_are_400_not_500(api, mallory, verifier):
    r = api.post("/api/datasets/", {"file": SimpleUploadedFile("t.jsonl", ROW.encode()), "verifier": verifier},
                 format="multipart")
    assert r.status_code == 400, (verifier, r.status_code, r.content[:300])
    ds, ep = make_dataset(mallory), make_endpoint(mallory)
    r = api.post("/api/jobs/", {"dataset": ds.pk, "endpoint": ep.pk, "verifier": verifier}, format="json")
    assert r.status_code == 400, (verifier, r.status_code, r.content[:300])


def test_job_creation_api_form_and_verify_endpoint_refuse_a_module_path(api, web, mallory, canary):
    name, _ = canary
    ds, ep = make_dataset(mallory), make_endpoint(mallory)
    r = api.post("/api/jobs/", {"dataset": ds.pk, "endpoint": ep.pk, "verifier": f"{name}:x"}, format="json")
    assert r.status_code == 400 and "only the operator" in " ".join(r.json()["verifier"]), r.content
    r = web.post(f"/datasets/{ds.pk}/", {"endpoint": ep.pk, "num_repeats": 1, "num_samples_in_parallel": 2,
                                          "verify_mode": "inline", "chunk_size": 5, "verify_cache": "job",
                                          "verifier": f"{name}:x"})
    assert r.status_code == 400 and "only the operator" in r.content.decode()
    assert not CollectionJob.objects.exists()
    # a finished job, verified again "with" the module: refused, and its own verifier is checked the same way
    job = CollectionJob.objects.create(owner=mallory, dataset=ds, endpoint=ep, state="completed", verifier="math",
                                       total_rollouts=1)
    r = api.post(f"/api/jobs/{job.pk}/verify/", {"verifier": f"{name}:x"}, format="json")
    assert r.status_code == 400 and "verifier" in r.json(), r.content
    CollectionJob.objects.filter(pk=job.pk).update(verifier=f"{name}:x")  # stored before the checks existed
    r = api.post(f"/api/jobs/{job.pk}/verify/", {}, format="json")
    assert r.status_code == 400 and "verifier" in r.json(), r.content
    assert not VerificationRun.objects.exists()
    assert _not_imported(canary)


def test_the_operator_lists_modules_and_keeps_dotted_paths_in_manage_py(api, mallory, canary, settings, tmp_path):
    name, marker = canary
    # manage.py commands are the operator's: load_dataset takes the dotted path (and imports it)
    path = tmp_path / "t.jsonl"
    path.write_text(ROW)
    call_command("load_dataset", str(path), "--verifier", f"{name}:x", stdout=io.StringIO())
    assert marker.exists() and Dataset.objects.filter(validation_report__verifier=f"{name}:x").exists()
    # a module the operator lists: users may name verifiers in it
    settings.VERIFIER_PATH_MODULES = [name]
    ds, ep = make_dataset(mallory), make_endpoint(mallory)
    r = api.post("/api/jobs/", {"dataset": ds.pk, "endpoint": ep.pk, "verifier": f"{name}:x"}, format="json")
    assert r.status_code == 201, r.content
    # ... but not a dotted path into another module through it
    r = api.post("/api/jobs/", {"dataset": ds.pk, "endpoint": ep.pk, "verifier": f"{name}:os.system"}, format="json")
    assert r.status_code == 400
