"""Seed and launch the demo: a user, the shipped math dataset, the simulator endpoint, one job.
Then follow the job in the terminal while the browser shows it live."""
import argparse
import os
import secrets
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

import django  # noqa: E402

django.setup()

from django.contrib.auth import get_user_model  # noqa: E402
from tqdm import tqdm  # noqa: E402

from controlplane.datasets.models import Dataset  # noqa: E402
from controlplane.datasets.services import ingest_jsonl  # noqa: E402
from controlplane.endpoints.models import Endpoint  # noqa: E402
from controlplane.jobs.models import TERMINAL_STATES  # noqa: E402
from controlplane.jobs.services import create_job  # noqa: E402

DATASET_PATH = ROOT / "data" / "demo_math.jsonl"


def demo_user():
    pw_file = ROOT / "var" / "demo_password"
    if not pw_file.exists():
        pw_file.write_text(secrets.token_urlsafe(12))
        pw_file.chmod(0o600)
    password = pw_file.read_text().strip()
    user, _ = get_user_model().objects.get_or_create(username="demo", defaults={"is_staff": True, "is_superuser": True})
    user.set_password(password)
    user.is_staff = user.is_superuser = True
    user.save()
    return user, password


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--simulator-url", required=True)
    ap.add_argument("--web-url", required=True)
    args = ap.parse_args()

    user, password = demo_user()
    dataset = Dataset.objects.filter(owner=user, name="demo_math", status=Dataset.Status.READY).first()
    if dataset is None:
        with open(DATASET_PATH, "rb") as fh:
            dataset = ingest_jsonl(fh, name="demo_math", owner=user, source_filename=DATASET_PATH.name)
    endpoint, _ = Endpoint.objects.update_or_create(
        owner=user, name="Built-in simulator",
        defaults={"base_url": args.simulator_url, "model_name": "sim", "kind": Endpoint.Kind.VLLM,
                  "request_timeout_s": 60, "max_retries": 3},
    )
    job = create_job(owner=user, dataset=dataset, endpoint=endpoint, name="Demo: math on the simulator",
                     num_repeats=8, num_samples_in_parallel=24, verifier="math", chunk_size=100,
                     responses_create_params={"max_output_tokens": 64, "temperature": 0.7})

    web = args.web_url.rstrip("/")
    print(f"""
  Dashboard:   {web}/            (user: demo   password: {password})
  This job:    {web}/jobs/{job.pk}/
  Admin:       {web}/admin/
  API docs:    {web}/api/docs/
  Logs:        var/log/    Stop everything: make stop
""")
    # In a terminal the bar redraws in place; in a log (no TTY) a line every few seconds is enough.
    bar = tqdm(total=job.total_rollouts, desc=f"Demo job {job.pk}", unit="rollout",
               mininterval=0.5 if sys.stderr.isatty() else 5.0)
    while True:
        job.refresh_from_db()
        bar.set_postfix(state=job.state, failed=job.failed_count, refresh=False)
        bar.update(job.done_count - bar.n)  # redraws at most every mininterval
        if job.state in TERMINAL_STATES:
            break
        time.sleep(0.5)
    bar.close()
    reward = job.aggregate_metrics.get("mean/reward")
    print(f"Job {job.pk} {job.state}: {job.completed_count} rollouts, {job.failed_count} failed"
          + (f", mean reward {reward:.3f}" if isinstance(reward, (int, float)) else ""))
    if job.state != "completed":
        print(f"  {job.error_message}")
    print(f"Services are still running: open {web}/jobs/{job.pk}/ ; `make stop` stops them.")
    return 0 if job.state == "completed" else 1


if __name__ == "__main__":
    sys.exit(main())
