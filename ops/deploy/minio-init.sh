#!/bin/sh
# One-shot MinIO set-up for docker-compose (runs in the minio/mc image): the bucket and a
# dedicated read-write user for the service, so Stencil never holds MinIO's root credentials.
# Idempotent: re-running on an existing deployment changes nothing.
set -eu
: "${MINIO_ROOT_USER:?}" "${MINIO_ROOT_PASSWORD:?}" "${STENCIL_S3_BUCKET:?}"
: "${STENCIL_S3_ACCESS_KEY:?}" "${STENCIL_S3_SECRET_KEY:?}"
ENDPOINT="${MINIO_ENDPOINT:-http://minio:9000}"

i=0
until mc alias set stencil "$ENDPOINT" "$MINIO_ROOT_USER" "$MINIO_ROOT_PASSWORD" >/dev/null 2>&1; do
  i=$((i + 1))
  [ "$i" -ge 30 ] && { echo "minio-init: MinIO at $ENDPOINT not reachable" >&2; exit 1; }
  sleep 1
done
mc mb --ignore-existing "stencil/$STENCIL_S3_BUCKET"
mc admin user add stencil "$STENCIL_S3_ACCESS_KEY" "$STENCIL_S3_SECRET_KEY"
# `policy attach` fails when the policy is already attached: that is the idempotent case.
mc admin policy attach stencil readwrite --user "$STENCIL_S3_ACCESS_KEY" 2>/dev/null \
  || mc admin user info stencil "$STENCIL_S3_ACCESS_KEY" | grep -q readwrite
echo "minio-init: bucket $STENCIL_S3_BUCKET and user $STENCIL_S3_ACCESS_KEY ready"
