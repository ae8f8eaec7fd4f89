"""Object-store key layout, shared by the client and the workers."""

from __future__ import annotations


def template_key(template_id: str) -> str:
    return f"templates/{template_id}/image"


def result_key(job_id: str) -> str:
    return f"results/{job_id}.png"


# Templates without a given id are stored under their content digest: uploaded with a job, or
# added with ``add_template``.
UPLOAD_PREFIX = "upload-"
TEMPLATE_PREFIX = "tpl-"


def is_upload(template_id: str) -> bool:
    """A template uploaded with a job (content-addressed), also inside a tenant's namespace
    (``<tenant>.upload-...``, app/gateway/tenants.py): kept only while it decodes, warmed when seen again."""
    return template_id.rpartition(".")[2].startswith(UPLOAD_PREFIX)

# A GPU worker's lease on denoising a job (renewed by its engine every step).
LEASE_PREFIX = "stencil:lease:"
