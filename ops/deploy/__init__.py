"""Deployment helpers: what docker-compose.yml runs inside the containers (healthchecks, MinIO and
Prometheus set-up), the compose lint behind ``ops/compose_check.sh``, and installers of tools the
tests need (``install_chromium.sh``)."""
