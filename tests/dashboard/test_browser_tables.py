"""The job page's aggregate metrics and timing tables and the rollout browser, in headless Chromium against
a live daphne: a finished job (rows written directly, summaries computed by the job service) shows one row per
metric field with mean / median / min / max / std, pass@k in its own table, the slot wait named and explained,
and each rollout's last user message and start of answer. Screenshots go to test-artifacts/."""
from __future__ import annotations

import os

import pytest
from django.db import connection

from controlplane.jobs.services import compute_summaries
from tests.factories import make_dataset, make_endpoint, make_job, make_user

from . import servers

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

ARTIFACTS = servers.REPO / "test-artifacts"
REDIS_DB = int(os.environ.get("DASHBOARD_TEST_REDIS_DB", "11"))


@pytest.fixture
def finished_job_site(transactional_db, monkeypatch):
    servers.prepare_browser(monkeypatch)
    from django.conf import settings

    user = make_user("dora", "dora-pw-123")
    ds = make_dataset(user, n=30)
    job = make_job(user, ds, make_endpoint(user), n_rollouts=120, repeats=4, fail_every=12, name="tables",
                   rewards=lambda t, r: 1.0 if (t + r) % 3 else 0.0)
    job.aggregate_metrics, job.timing_summary = compute_summaries(job)
    job.save(update_fields=["aggregate_metrics", "timing_summary"])
    env = servers.child_env(servers.database_url(connection.settings_dict),
                            servers.redis_url_with_db(settings.REDIS_URL, REDIS_DB))
    daphne, url = servers.start_daphne(env)
    try:
        yield {"url": url, "job": job}
    finally:
        daphne.stop()


def test_aggregate_table_and_rollout_browser_in_chromium(finished_job_site):
    from playwright.sync_api import sync_playwright

    url, job = finished_job_site["url"], finished_job_site["job"]
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=servers.CHROMIUM, args=servers.CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1360, "height": 1000})
            page.goto(url + "/accounts/login/")
            servers.log_in(page, "dora", "dora-pw-123")

            page.goto(url + f"/jobs/{job.pk}/")
            table = page.locator("#metrics-table")
            assert table.locator("thead th").all_inner_texts() == ["field", "mean", "median", "min", "max", "std"]
            fields = table.locator("tbody th").all_inner_texts()
            assert fields[0] == "reward" and "output_tokens" in fields
            assert len(fields) == len(set(fields)) and len(fields) < 15  # one row per field, not 40+ flat keys
            reward = table.locator("tbody tr[data-field=reward] td").all_inner_texts()
            ok_rewards = [1.0 if (t + r) % 3 else 0.0 for i in range(120) for t, r in [divmod(i, 4)] if i % 12 != 11]
            assert float(reward[0]) == pytest.approx(sum(ok_rewards) / len(ok_rewards), abs=1e-4)  # mean
            assert (float(reward[2]), float(reward[3])) == (0.0, 1.0)  # min, max
            passk = page.locator("#passk-table tbody th").all_inner_texts()
            assert passk[0] == "pass@1" and "pass@4" in passk and all(m.startswith(("pass@", "majority@")) for m in passk)
            assert not any("@" in f for f in fields)
            stage = page.locator("#timing-table tbody tr[data-stage=queue] th")
            assert stage.inner_text() == "slot wait" and "parallelism slot" in stage.get_attribute("title")
            table.scroll_into_view_if_needed()
            page.locator("#metrics-table").locator("xpath=ancestor::section").screenshot(
                path=str(ARTIFACTS / "job_aggregate_metrics.png"))
            page.locator("#timing-table").locator("xpath=ancestor::section").screenshot(
                path=str(ARTIFACTS / "job_timing_table.png"))

            page.goto(url + f"/jobs/{job.pk}/rollouts/")
            heads = page.locator("#rollouts-table thead th").all_inner_texts()
            assert heads[3:5] == ["last user message", "answer"]
            first = page.locator("#rollouts-table tbody tr").first
            assert first.locator("td.prompt").inner_text() == "What is 0 + 1?"
            assert first.locator("td.answer").inner_text() == "The answer is \\boxed{1}"
            failed = page.locator("#rollouts-table tbody tr.status-failed").first
            assert failed.locator("td.answer").inner_text() == "http_429"  # no answer: the failure says why
            page.screenshot(path=str(ARTIFACTS / "rollout_browser.png"), full_page=True)
        finally:
            browser.close()
    for name in ("job_aggregate_metrics.png", "job_timing_table.png", "rollout_browser.png"):
        assert (ARTIFACTS / name).stat().st_size > 5000
