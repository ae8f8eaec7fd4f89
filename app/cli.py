"""The ``stencil`` command: client operations and the commands that start each process."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from app.fidelity import POLICIES
from app.secrets import InsecureConfiguration, check_basic_auth, check_secrets
from app.settings import Settings
from app.validation import InvalidParameter

log = logging.getLogger("stencil")


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _client():  # type: ignore[no-untyped-def]
    from app.client import StencilClient

    return StencilClient()


def cmd_submit(args: argparse.Namespace) -> int:
    client = _client()
    template: object = Path(args.template) if Path(args.template).is_file() else args.template
    handle = client.submit(template=template, mask=Path(args.mask), prompt=args.prompt,
                           negative_prompt=args.negative_prompt, steps=args.steps, guidance=args.guidance,
                           strength=args.strength, seed=args.seed, priority=args.priority,
                           deadline=args.deadline, idempotency_key=args.idempotency_key,
                           keep_unmasked=args.keep_unmasked, fidelity=args.fidelity, loras=";".join(args.lora),
                           lora_patch=args.lora_patch, controls=[parse_control(c) for c in args.control])
    sys.stdout.write(handle.id + "\n")
    if args.wait:
        return _wait(handle, args.timeout, args.out)
    return 0


def _wait(handle, timeout: float | None, out: str | None) -> int:  # type: ignore[no-untyped-def]
    rec = handle.wait(timeout)
    sys.stdout.write(json.dumps(rec.as_dict(), indent=2, sort_keys=True) + "\n")
    if rec.status.value == "done" and out:
        Path(out).write_bytes(handle.result_bytes())
    return 0 if rec.status.value == "done" else 1


def cmd_status(args: argparse.Namespace) -> int:
    rec = _client().job(args.job_id).record()
    sys.stdout.write(json.dumps(rec.as_dict(), indent=2, sort_keys=True) + "\n")
    return 0


def cmd_wait(args: argparse.Namespace) -> int:
    return _wait(_client().job(args.job_id), args.timeout, args.out)


def cmd_cancel(args: argparse.Namespace) -> int:
    ok = _client().job(args.job_id).cancel()
    sys.stdout.write(("cancelled" if ok else "not cancelled (already finished)") + "\n")
    return 0 if ok else 1


def cmd_template_add(args: argparse.Namespace) -> int:
    template_id = _client().add_template(Path(args.image), args.id)
    sys.stdout.write(template_id + "\n")
    return 0


def cmd_template_warm(args: argparse.Namespace) -> int:
    handle = _client().warm_template(args.template_id, steps=args.steps, guidance=args.guidance,
                                     strength=args.strength, prompt=args.prompt, seed=args.seed,
                                     negative_prompt=args.negative_prompt,
                                     mask=Path(args.mask) if args.mask else None, loras=";".join(args.lora))
    sys.stdout.write(handle.id + "\n")
    return _wait(handle, args.timeout, None) if args.wait else 0


def parse_control(text: str) -> tuple[str, Path, float, float, float]:
    """``ID:IMAGE[:SCALE[:START:END]]`` (the CLI's form of a control)."""
    parts = text.split(":")
    if len(parts) not in (2, 3, 5):
        raise InvalidParameter("--control", f"expected ID:IMAGE[:SCALE[:START:END]], got {text!r}")
    numbers = [float(v) for v in parts[2:]] if all(_is_number(v) for v in parts[2:]) else None
    if numbers is None:
        raise InvalidParameter("--control", f"SCALE, START and END must be numbers in {text!r}")
    scale, start, end = (numbers + [1.0, 0.0, 1.0][len(numbers):])[:3]
    return parts[0], Path(parts[1]), scale, start, end


def _is_number(v: str) -> bool:
    try:
        float(v)
    except ValueError:
        return False
    return True


def _add(what: str, call) -> int:  # type: ignore[no-untyped-def]
    """``stencil lora add`` / ``controlnet add``: the stored description, or the refusal (exit 2)."""
    from app.client import InvalidAdapter

    try:
        meta = call()
    except InvalidAdapter as exc:
        sys.stderr.write(f"stencil {what} add: {exc}\n")
        return 2
    sys.stdout.write(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return 0


def cmd_controlnet_add(args: argparse.Namespace) -> int:
    return _add("controlnet", lambda: _client().add_controlnet(Path(args.dir), args.id, timeout=args.timeout))


def cmd_controlnet_list(args: argparse.Namespace) -> int:
    for meta in _client().list_controlnets():
        sys.stdout.write(f"{meta['id']}\t{meta.get('nbytes', 0) / 2**20:.1f} MiB\t"
                         f"{meta.get('parameters', 0) / 1e6:.1f} M parameters\n")
    return 0


def cmd_lora_add(args: argparse.Namespace) -> int:
    return _add("lora", lambda: _client().add_lora(Path(args.file), args.id, timeout=args.timeout))


def cmd_lora_list(args: argparse.Namespace) -> int:
    rows = _client().list_loras()
    if args.json:
        sys.stdout.write(json.dumps(rows, indent=2, sort_keys=True) + "\n")
        return 0
    for meta in rows:
        comps = ", ".join(f"{c} ({v['modules']} modules, rank {'/'.join(map(str, v['ranks']))})"
                          for c, v in sorted(meta.get("components", {}).items()))
        sys.stdout.write(f"{meta['id']}\t{meta.get('nbytes', 0) / 2**20:.1f} MiB\t{comps}\n")
    return 0


def cmd_model_save(args: argparse.Namespace) -> int:
    from app.settings import Settings
    from workers.models.loader import save_embedded

    save_embedded(args.model or Settings.from_env().model_id, args.dir, seed=args.seed, dtype=args.dtype or None)
    return 0


def _set_role(role: str) -> None:
    """Tell the worker modules what this process serves (``workers.context.role``)."""
    from workers import context

    context.set_role(role)


def _worker_argv(queues: str, pool: str, concurrency: int, name: str, loglevel: str) -> list[str]:
    return ["worker", "-Q", queues, "-P", pool, "-c", str(concurrency), "-n", f"{name}@%h", "-E",
            f"--loglevel={loglevel}", "--without-mingle", "--without-gossip"]


def cmd_gpu_worker(args: argparse.Namespace) -> int:
    os.environ["STENCIL_WORKER_ID"] = args.worker_id
    _set_role("gpu")
    if args.max_batch:
        os.environ["STENCIL_MAX_BATCH"] = str(args.max_batch)
    if args.batching:
        os.environ["STENCIL_BATCHING"] = args.batching
    settings = Settings.from_env()
    # Threads, not prefork: CUDA does not survive fork. Enough threads for a full batch + a queue.
    concurrency = args.concurrency or settings.max_batch * 2 + 2
    from app.celery_app import app, gpu_queue
    from app.metrics import start_metrics_server

    check_secrets()
    start_metrics_server(settings.metrics_port, settings.metrics_address)

    app.worker_main(_worker_argv(gpu_queue(args.worker_id), "threads", concurrency,
                                 f"gpu{args.worker_id}", args.log_level))
    return 0


def cmd_cpu_worker(args: argparse.Namespace) -> int:
    _set_role("cpu")
    from app.celery_app import CPU_QUEUE, app
    from app.metrics import start_metrics_server

    check_secrets()
    settings = Settings.from_env()
    start_metrics_server(settings.metrics_port, settings.metrics_address)

    app.worker_main(_worker_argv(CPU_QUEUE, args.pool, args.concurrency, args.name, args.log_level))
    return 0


def cmd_stage_worker(args: argparse.Namespace) -> int:
    """The stage pool co-located with GPU worker ``--worker-id``: prepare/finalize of the jobs routed
    to that worker (queue ``stage.<id>``), their text encoders and VAE on STENCIL_STAGE_DEVICE."""
    os.environ["STENCIL_WORKER_ID"] = args.worker_id
    _set_role("stage")
    settings = Settings.from_env()
    from workers.devices import DeviceUnavailable, resolve_device

    try:  # a host without the configured device: stop now, with the reason
        resolve_device(settings.stage_device, "STENCIL_STAGE_DEVICE")
    except DeviceUnavailable as exc:
        log.error("%s", exc)
        return 2
    from app.celery_app import app, stage_queue
    from app.metrics import start_metrics_server

    check_secrets()
    start_metrics_server(settings.metrics_port, settings.metrics_address)
    # Threads, not prefork: CUDA does not survive fork, and the threads share one copy of the modules.
    app.worker_main(_worker_argv(stage_queue(args.worker_id, "gpu_host"), "threads", args.concurrency,
                                 f"stage{args.worker_id}", args.log_level))
    return 0


def cmd_dispatcher(args: argparse.Namespace) -> int:
    from app.celery_app import app
    from app.dispatcher import Dispatcher
    from app.metrics import default_queues, register_queue_collector, start_metrics_server

    check_secrets()
    settings = Settings.from_env()
    start_metrics_server(settings.metrics_port, settings.metrics_address)
    register_queue_collector(settings.redis_url, lambda: default_queues(settings))
    _run_until_sigterm(Dispatcher(settings, app).run)
    return 0


def _run_until_sigterm(target) -> None:  # type: ignore[no-untyped-def]
    import signal
    import threading

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    target(stop)


def cmd_stock_worker(args: argparse.Namespace) -> int:
    from workers.stock_worker import StockWorker

    if args.max_batch:
        os.environ["STENCIL_MAX_BATCH"] = str(args.max_batch)
    _run_until_sigterm(StockWorker(Settings.from_env(), args.worker_id).run)
    return 0


def cmd_stock_router(args: argparse.Namespace) -> int:
    from workers.stock_worker import StockRouter

    _run_until_sigterm(StockRouter(Settings.from_env()).run)
    return 0


def _check_flower_db(db: str) -> None:
    """Flower's state file must be a regular file: Flower moves an unreadable one aside and
    replaces it atomically on save, which would destroy a device such as ``/dev/null``."""
    for suffix in ("", ".db", ".dat", ".dir", ".bak"):
        path = Path(db + suffix)
        if path.exists() and not path.is_file():
            raise SystemExit(f"--db {db}: {path} exists and is not a regular file (Flower would replace it); "
                             "name a file path, e.g. flower.db")


def cmd_flower(args: argparse.Namespace) -> int:
    """Flower with credentials, or (``--no-auth``, explicitly) without them on loopback only."""
    check_secrets(flower=True)
    if args.no_auth:
        if args.basic_auth:
            raise InsecureConfiguration("--no-auth and --basic-auth (or FLOWER_BASIC_AUTH) together")
        address = args.address or "127.0.0.1"
        if address not in ("127.0.0.1", "localhost", "::1"):
            raise InsecureConfiguration("--no-auth serves Flower without a password: loopback only, "
                                        f"not --address {address}")
    else:
        if not args.basic_auth:
            raise InsecureConfiguration("Flower needs credentials: --basic-auth user:password or "
                                        "FLOWER_BASIC_AUTH (or --no-auth to serve it on 127.0.0.1 only)")
        check_basic_auth(args.basic_auth)
        address = args.address or "127.0.0.1"
    _check_flower_db(args.db)
    argv = [sys.executable, "-m", "celery", "-A", "app.celery_app:app", "flower", f"--port={args.port}",
            f"--address={address}", "--persistent=True", f"--db={args.db}", "--max_tasks=10000"]
    if args.basic_auth:
        argv.append(f"--basic-auth={args.basic_auth}")
    os.execv(sys.executable, argv)
    return 0  # not reached


def cmd_serve(args: argparse.Namespace) -> int:
    from app.serve import serve
    from workers.models.loader import DeviceUnavailable

    check_secrets(flower=bool(args.flower_port))
    try:
        return serve(Path(args.workdir), gpu_workers=args.gpu_workers, cpu_concurrency=args.cpu_concurrency,
                     flower_port=args.flower_port, flower_auth=args.flower_basic_auth,
                     redis_url=os.environ.get("STENCIL_REDIS_URL", ""), device=args.device)
    except DeviceUnavailable as exc:  # nothing started: a device this host lacks
        sys.stderr.write(f"stencil serve: {exc}\n")
        return 2


def cmd_api(args: argparse.Namespace) -> int:
    from app.gateway.server import serve

    return serve(Settings.from_env(), host=args.host, port=args.port, access_log=args.access_log)


def cmd_webhook_sender(args: argparse.Namespace) -> int:
    from app.webhook_sender import WebhookSender

    check_secrets()
    _run_until_sigterm(WebhookSender(Settings.from_env(), threads=args.threads).run)
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    """The effective settings of this process (secrets masked), or with ``--markdown`` the
    configuration reference (docs/configuration.md)."""
    from app import config_doc

    sys.stdout.write(config_doc.markdown() if args.markdown else config_doc.effective(Settings.from_env()))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from app.demo import run_demo

    return run_demo(jobs=args.jobs, out_dir=Path(args.out), steps=args.steps, keep_unmasked=not args.raw,
                    addons=not args.no_addons)


def _run_ops(module: str, argv: list[str]) -> int:
    import importlib

    return int(importlib.import_module(module).main(argv) or 0)


def _run_bench(args: argparse.Namespace) -> int:
    import pkgutil

    import ops.bench

    names = sorted(m.name for m in pkgutil.iter_modules(ops.bench.__path__) if m.name != "harness")
    if args.name not in names:
        sys.stderr.write(f"stencil bench: no benchmark {args.name!r}; one of: {', '.join(names)}\n")
        return 2
    return _run_ops(f"ops.bench.{args.name}", args.args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stencil", description=__doc__)
    p.add_argument("--log-level", default=os.environ.get("STENCIL_LOG_LEVEL", "INFO"))
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("submit", help="submit an edit job")
    s.add_argument("--template", required=True, help="image file to upload, or a stored template id")
    s.add_argument("--mask", required=True, help="mask image file (white = edit)")
    s.add_argument("--prompt", default="")
    s.add_argument("--negative-prompt", default="")
    s.add_argument("--keep-unmasked", action="store_true",
                   help="paste the template back outside the mask (exact template pixels there)")
    s.add_argument("--fidelity", default="", choices=("", *POLICIES),
                   help="exact | balanced | fast (default: the service's STENCIL_FIDELITY)")
    s.add_argument("--lora", action="append", default=[], metavar="ID[:SCALE]",
                   help="a LoRA adapter added with `stencil lora add` (repeat for several; scale 1.0 if omitted)")
    s.add_argument("--control", action="append", default=[], metavar="ID:IMAGE[:SCALE[:START:END]]",
                   help="a ControlNet added with `stencil controlnet add` and its control image (repeatable)")
    s.add_argument("--lora-patch", default="", choices=("", "exact", "late"),
                   help="exact: adapters from the first step; late: may start before they are loaded "
                        "(default: exact)")
    s.add_argument("--steps", type=int, default=20)
    s.add_argument("--guidance", type=float, default=7.5)
    s.add_argument("--strength", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--priority", type=int, default=0)
    s.add_argument("--deadline", type=float, default=None, help="absolute epoch seconds")
    s.add_argument("--idempotency-key", default=None)
    s.add_argument("--wait", action="store_true")
    s.add_argument("--timeout", type=float, default=None)
    s.add_argument("--out", default=None, help="with --wait: write the result PNG here")
    s.set_defaults(func=cmd_submit)

    s = sub.add_parser("status", help="print a job record")
    s.add_argument("job_id")
    s.set_defaults(func=cmd_status)

    s = sub.add_parser("wait", help="wait for a job; optionally save its result")
    s.add_argument("job_id")
    s.add_argument("--timeout", type=float, default=None)
    s.add_argument("--out", default=None)
    s.set_defaults(func=cmd_wait)

    s = sub.add_parser("cancel", help="cancel a queued or running job")
    s.add_argument("job_id")
    s.set_defaults(func=cmd_cancel)

    t = sub.add_parser("template", help="manage stored templates").add_subparsers(dest="tcmd", required=True)
    s = t.add_parser("add", help="store a template image")
    s.add_argument("image")
    s.add_argument("--id", default=None)
    s.set_defaults(func=cmd_template_add)

    s = t.add_parser("warm", help="record a template's activations (full inference) for mask-aware edits")
    s.add_argument("template_id")
    s.add_argument("--steps", type=int, default=20)
    s.add_argument("--guidance", type=float, default=7.5)
    s.add_argument("--strength", type=float, default=1.0)
    s.add_argument("--prompt", default="")
    s.add_argument("--negative-prompt", default="")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--mask", default=None, help="a region warm-up: edits with this mask, prompt, negative "
                                                "prompt, seed and guidance are then exact")
    s.add_argument("--lora", action="append", default=[], metavar="ID[:SCALE]",
                   help="record with these adapters (edits with the same adapter set use this cache)")
    s.add_argument("--wait", action="store_true")
    s.add_argument("--timeout", type=float, default=None)
    s.set_defaults(func=cmd_template_warm)

    lo = sub.add_parser("lora", help="LoRA adapters").add_subparsers(dest="lcmd", required=True)
    s = lo.add_parser("add", help="add an adapter (safetensors, any format diffusers' load_lora_weights reads); "
                                  "validated against the service's model")
    s.add_argument("file")
    s.add_argument("--id", required=True, help="the id jobs name it by (letters, digits, . _ -)")
    s.add_argument("--timeout", type=float, default=300.0)
    s.set_defaults(func=cmd_lora_add)
    s = lo.add_parser("list", help="the stored adapters")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_lora_list)

    cn = sub.add_parser("controlnet", help="ControlNets").add_subparsers(dest="ccmd", required=True)
    s = cn.add_parser("add", help="add a diffusers ControlNetModel folder (config.json + safetensors weights); "
                                  "checked against the service's model")
    s.add_argument("dir")
    s.add_argument("--id", required=True, help="the id jobs name it by (letters, digits, . _ -)")
    s.add_argument("--timeout", type=float, default=600.0)
    s.set_defaults(func=cmd_controlnet_add)
    s = cn.add_parser("list", help="the stored ControlNets")
    s.set_defaults(func=cmd_controlnet_list)

    m = sub.add_parser("model", help="model utilities").add_subparsers(dest="mcmd", required=True)
    s = m.add_parser("save", help="write an embedded model (default: STENCIL_MODEL_ID) as a diffusers pipeline folder")
    s.add_argument("dir")
    s.add_argument("--model", default="", help="tiny-sd-inpaint-trained | tiny-sd-inpaint (random init) | "
                   "tiny-flux-fill | tiny-sdxl-inpaint (random init) | true-size random init: sd15-inpaint | "
                   "sdxl-inpaint | flux-fill | flux-fill-subset (workers/models/true_size.py); default: the configured model id")
    s.add_argument("--seed", type=int, default=0, help="random-init models only")
    s.add_argument("--dtype", default="", choices=["", "float32", "float16", "bfloat16"],
                   help="weights' dtype (true-size models; default bfloat16: half the bytes, written "
                        "shard by shard in about 2 GB of RAM); the tiny models are float32")
    s.set_defaults(func=cmd_model_save)

    s = sub.add_parser("gpu-worker", help="start a GPU worker (one engine) for queue gpu.<id>")
    s.add_argument("--worker-id", default=os.environ.get("STENCIL_WORKER_ID", "0"))
    s.add_argument("--max-batch", type=int, default=0)
    s.add_argument("--batching", choices=["continuous", "static", "bucketed"], default=None)
    s.add_argument("--concurrency", type=int, default=0)
    s.set_defaults(func=cmd_gpu_worker)

    s = sub.add_parser("cpu-worker", help="start a CPU worker (prepare/finalize tasks)")
    s.add_argument("--concurrency", type=int, default=1)
    s.add_argument("--pool", default="prefork")
    s.add_argument("--name", default="cpu")
    s.set_defaults(func=cmd_cpu_worker)

    s = sub.add_parser("stage-worker", help="start the stage pool of GPU host <id> (prepare/finalize on "
                       "STENCIL_STAGE_DEVICE, queue stage.<id>; STENCIL_STAGE_PLACEMENT=gpu_host)")
    s.add_argument("--worker-id", default=os.environ.get("STENCIL_WORKER_ID", "0"))
    s.add_argument("--concurrency", type=int, default=2)
    s.set_defaults(func=cmd_stage_worker)

    s = sub.add_parser("dispatcher", help="start the dispatcher")
    s.set_defaults(func=cmd_dispatcher)

    s = sub.add_parser("stock-worker", help="benchmark baseline: stock diffusers pipeline, static batches")
    s.add_argument("--worker-id", default="0")
    s.add_argument("--max-batch", type=int, default=0)
    s.set_defaults(func=cmd_stock_worker)

    s = sub.add_parser("stock-router", help="benchmark baseline: round-robin router for stock workers")
    s.set_defaults(func=cmd_stock_router)

    s = sub.add_parser("flower", help="start Flower (Celery monitoring) for this app")
    s.add_argument("--port", type=int, default=5555)
    s.add_argument("--address", default="", help="listen address (default 127.0.0.1; 0.0.0.0 needs --basic-auth)")
    s.add_argument("--basic-auth", default=os.environ.get("FLOWER_BASIC_AUTH", ""))
    s.add_argument("--no-auth", action="store_true", help="serve without credentials, on loopback only")
    s.add_argument("--db", default=os.environ.get("FLOWER_DB", "flower.db"))
    s.set_defaults(func=cmd_flower)

    s = sub.add_parser("serve", help="a supervised local stack in the foreground (Ctrl-C stops it)")
    s.add_argument("--workdir", default="stencil-serve",
                   help="state, logs and stencil.env (client settings) go here")
    s.add_argument("--gpu-workers", type=int, default=1, help="one per device")
    s.add_argument("--device", default="", help="the engines' torch device (sets STENCIL_DEVICE of the processes "
                   "serve starts): cuda = worker k on cuda:k, with the stages in each GPU host's stage pool on "
                   "the same GPU; cpu; cuda:N; default: STENCIL_DEVICE")
    s.add_argument("--cpu-concurrency", type=int, default=2)
    s.add_argument("--flower-port", type=int, default=0, help="also run Flower on this port (0 = no)")
    s.add_argument("--flower-basic-auth", default=os.environ.get("FLOWER_BASIC_AUTH", ""),
                   help="user:password (without: Flower on 127.0.0.1 without auth)")
    s.set_defaults(func=cmd_serve)

    s = sub.add_parser("api", help="the HTTP gateway (API keys per tenant, OpenAPI at /docs, a web page at /)")
    s.add_argument("--host", default="", help="listen address (default STENCIL_BIND_ADDRESS: 127.0.0.1)")
    s.add_argument("--port", type=int, default=None, help="default STENCIL_API_PORT (8080)")
    s.add_argument("--access-log", action="store_true", help="log every request")
    s.set_defaults(func=cmd_api)

    s = sub.add_parser("webhook-sender", help="deliver signed webhooks of jobs that ended (retried with backoff)")
    s.add_argument("--threads", type=int, default=8, help="POSTs in flight at most")
    s.set_defaults(func=cmd_webhook_sender)

    s = sub.add_parser("config", help="print this process's effective settings (secrets masked), for a bug report")
    s.add_argument("--markdown", action="store_true",
                   help="print the configuration reference instead (> docs/configuration.md)")
    s.set_defaults(func=cmd_config)

    s = sub.add_parser("demo", help="run the embedded stack end to end and write results")
    s.add_argument("--jobs", type=int, default=4)
    s.add_argument("--out", default="demo-out")
    s.add_argument("--steps", type=int, default=20)
    s.add_argument("--raw", action="store_true",
                   help="return the model's decoded output everywhere (no template paste-back outside the mask)")
    s.add_argument("--no-addons", action="store_true",
                   help="skip the add-on jobs (one template with each trained LoRA and the trained ControlNet)")
    s.set_defaults(func=cmd_demo)

    for name, module, text in (("profile", "ops.bench.profile", "fit the dispatcher's cost model on this device"),
                               ("simulate", "ops.bench.simulate", "cluster simulation of the routing policies"),
                               ("replay", "ops.bench.replay", "replay a trace against a real embedded stack")):
        s = sub.add_parser(name, help=text, add_help=False)
        s.add_argument("args", nargs=argparse.REMAINDER)
        s.set_defaults(func=lambda a, module=module: _run_ops(module, a.args))
    s = sub.add_parser("bench", help="run a benchmark of ops/bench: stencil bench NAME [--quick] [--out ...]")
    s.add_argument("name", help="the benchmark (a module of ops/bench, e.g. fidelity, e2e, simulate)")
    s.add_argument("args", nargs=argparse.REMAINDER)
    s.set_defaults(func=_run_bench)

    from app.catalog import add_catalog_commands
    from app.gateway.admin_cli import add_admin_commands

    add_catalog_commands(sub)
    add_admin_commands(sub)
    return p


def _limit_threads() -> None:
    threads = Settings.from_env().torch_threads
    if threads > 0:
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        import torch

        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not hasattr(args, "args"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:  # a passthrough's leading options (argparse's REMAINDER takes only what follows a positional)
        args.args = extra + args.args
    _setup_logging(args.log_level)
    if args.command in {"gpu-worker", "cpu-worker", "stock-worker", "demo"}:
        _limit_threads()
    args.log_level = args.log_level.upper()
    try:
        return int(args.func(args) or 0)
    except InvalidParameter as exc:  # a user's mistake: one line, no traceback
        sys.stderr.write(f"stencil {args.command}: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
