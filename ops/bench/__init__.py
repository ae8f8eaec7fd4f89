"""Benchmarks: one module per benchmark on one harness (``ops.bench.harness``).

Run any of them as ``python -m ops.bench.<name> [--quick] [--out ...]`` or ``stencil bench <name>``;
each writes its Markdown report (and plots) where ``--out`` says, under ``docs/bench/`` by default,
with the exact command line that produced it. ``--quick`` is a smoke run in seconds.

- per denoising step: ``maskaware_unet``, ``maskaware_flux``, ``policy_speed``, ``overheads``,
  ``batch_curve``, ``bubble`` (cache loading and prefetch), ``true_size`` (SD 1.5, SDXL and Flux Fill
  at their public sizes, mask-aware vs full per step), ``gpu_step`` (the same models on a GPU: full vs
  mask-aware steps, eager vs graph-replayed, batch scaling, kernels and host syncs per step),
  ``gpu_engine`` (the engine in process on a GPU: mask-aware and full compute against the stock
  pipeline on a burst of edits, jobs/s, latency, a steady step's phases), ``graph_churn`` (the share of
  the engine's steps that replay a CUDA graph under continuous batching), ``cache_bytes`` (cache bytes per template per
  storage codec at true sizes, codec fidelity, host-tier capacity, link-speed unit selection);
- fidelity: ``fidelity``, ``fidelity_causes``, ``fidelity_baselines``, ``temporal_reuse`` (``turbo``'s
  patch reuse from the last step on the frontier beside fixed-interval and whole-step reuse);
- whole service: ``e2e`` (against a stock diffusers server), ``e2e_gpu`` (the whole stack on one GPU
  against the stock pipeline on the same card: service overhead, Poisson runs on the mask-ratio
  traces, GPU busy share, time per phase), ``recovery`` (process faults), ``stack_start`` (a stack's
  start and a GPU worker's restart: processes forked by the preloaded launcher vs new interpreters),
  ``replay`` (a trace against a real 2-worker stack), ``api_load`` (edits over the HTTP gateway by
  concurrent clients: request latency, RSS over the run, one result per job);
- dispatch: ``profile`` (fits the cost model), ``simulate`` (8-64 worker cluster simulation),
  ``batching_sim`` (continuous vs static batching by batch-cost shape), ``mixed_sizes`` (mixed image
  sizes: one-at-a-time, bucketed, mixed and SLO-aware batching, real engine and simulator),
  ``mixing_cost`` (what one more image size in a step costs: a denoiser call per size),
  ``scheduler_cost`` (what an SLO-aware scheduling pass costs under a long queue);
- add-ons: ``lora`` (adapters vs the stock per-request path), ``controlnet`` (ControlNets vs the stock
  pipeline, overlapped with the UNet, the resident LRU), ``addons_gpu`` (both on one GPU at true size:
  latency fresh adapters add, a long-tail adapter trace, one ControlNet, against diffusers' own paths),
  ``addon_fidelity`` (late patching, add-ons with mask-aware caches).
- true-size deployment: ``placement`` (text encoders and VAE on the host CPU or the GPU: measured CPU
  costs at true sizes, published GPU costs, latency per placement), ``compiled`` (``torch.compile``
  vs eager denoising steps, full and mask-aware);
- precision: ``precision`` (float32 vs bfloat16 vs float16: exactness against the stock pipeline in
  each dtype, drift from float32, step time and cache bytes), ``batch_invariance`` (half-precision
  batches: what batched GEMMs change in a job's picture, and what multiplying job by job costs).
"""
