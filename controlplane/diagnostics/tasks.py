"""Celery entry points (thin, taking ids)."""
from celery import shared_task

from .models import ParallelismSweep


@shared_task(acks_late=True, ignore_result=True)
def run_sweep_task(sweep_id: int) -> str:
    from . import services

    sweep = ParallelismSweep.objects.filter(pk=sweep_id).first()
    if sweep is None:
        return "missing"
    return services.run_sweep(sweep).state
