"""Datasets admin: upload form streams through ingest_jsonl and shows the report; preview; rows list."""
import json

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse

from controlplane.datasets.models import Dataset

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin_client_ds(db, django_user_model, client):
    u = django_user_model.objects.create_superuser("ds-admin", "d@example.com", "pw-admin-1234")
    client.force_login(u)
    return client


def row(i):
    return json.dumps({"responses_create_params": {"input": f"What is {i}+{i}?"}, "expected_answer": str(2 * i)})


def test_upload_rejected_shows_every_bad_line(admin_client_ds):
    body = "\n".join([row(0), "{nope", row(1), '{"responses_create_params": {"input": []}}']) + "\n"
    f = SimpleUploadedFile("tasks.jsonl", body.encode())
    r = admin_client_ds.post(reverse("admin:datasets_dataset_upload"), {"file": f, "name": "t"})
    assert r.status_code == 200
    html = r.content.decode()
    assert "rejected" in html
    assert "<td>2</td><td>not valid JSON" in html
    assert "<td>4</td><td>responses_create_params.input is an empty list</td>" in html
    ds = Dataset.objects.get(name="t")
    assert ds.status == "rejected" and ds.row_count == 0


def test_upload_ok_then_change_page_preview_and_rows(admin_client_ds):
    body = "\n".join(row(i) for i in range(30)) + "\n"
    f = SimpleUploadedFile("ok.jsonl", body.encode())
    r = admin_client_ds.post(reverse("admin:datasets_dataset_upload"), {"file": f})
    assert r.status_code == 302
    ds = Dataset.objects.get(name="ok.jsonl")
    assert ds.row_count == 30 and ds.status == "ready"
    page = admin_client_ds.get(r["Location"]).content.decode()
    assert "What is 19+19?" in page and "What is 20+20?" not in page  # preview: first 20 rows
    lst = admin_client_ds.get(reverse("admin:datasets_dataset_changelist")).content.decode()
    assert ds.sha256[:12] in lst and "Upload JSONL" in lst
    rows = admin_client_ds.get(reverse("admin:datasets_datasetrow_changelist") + f"?dataset__id__exact={ds.pk}")
    assert rows.status_code == 200 and "What is 0+0?" in rows.content.decode()
    one = ds.rows.get(index=5)
    detail = admin_client_ds.get(reverse("admin:datasets_datasetrow_change", args=[one.pk]))
    assert detail.status_code == 200 and "What is 5+5?" in detail.content.decode()
