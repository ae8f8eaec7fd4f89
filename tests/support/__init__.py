"""Test helpers that start real backing services (no mocks): see ``s3server``."""
