"""Object-store key layout, shared by the client and the workers."""

from __future__ import annotations


def template_key(template_id: str) -> str:
    return f"templates/{template_id}/image"


def result_key(job_id: str) -> str:
    return f"results/{job_id}.png"
