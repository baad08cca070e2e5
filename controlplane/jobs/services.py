"""Job domain logic, callable from views, the API, tasks, admin and management commands.

CONTRACT (signatures other apps rely on; bodies are being filled in by the collection-spine work):
"""
from __future__ import annotations


def create_job(*, owner, dataset, endpoint, limit=None, num_repeats=1, num_samples_in_parallel=16,
               parallelism_auto=False, responses_create_params=None, verifier="math", verifier_options=None,
               verify_mode="inline", chunk_size=5000, name="", idempotency_key=None, profiling_enabled=False,
               output_path="", launch=True):
    """Create a CollectionJob (and its chunks) and, when launch, dispatch it to Celery. Returns the job.
    With an idempotency_key already used by this owner, returns the existing job instead."""
    raise NotImplementedError


def cancel_job(job):
    """Cancel; running workers stop within ~1 s. Raises models.InvalidTransition when it does not fit."""
    raise NotImplementedError


def pause_job(job):
    raise NotImplementedError


def resume_job(job):
    """Resume a paused, failed or cancelled job: re-dispatch unfinished chunks (exactly-once)."""
    raise NotImplementedError


def retry_failed(job):
    """Delete the job's failed rollouts and collect those (task, repeat) pairs again."""
    raise NotImplementedError
