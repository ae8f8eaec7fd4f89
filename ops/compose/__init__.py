"""Helpers that docker-compose.yml runs inside the containers (healthchecks, MinIO set-up)."""
