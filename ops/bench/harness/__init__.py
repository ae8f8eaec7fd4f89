"""The harness every benchmark runs on; benchmarks import only it, ``ops.sim`` and the product.

``cli``: shared options, logging, threads, the command line a report cites; ``timing``: clocks,
the side-by-side runner, medians, paired ratios, fits; ``report``: Markdown files, sections, plots;
``models``: benchmark-size models, masks, inputs; ``engine``: jobs through the engine in process,
per-step costs, the batch curve; ``runner_timing``: the runner's step on composed batches (the
model under test, in-RAM template caches); ``edits``: model families, warm-ups, edits per fidelity
option, image metrics; ``gpu``: the device, random weights made on it, a device clock, GPU
utilization; ``burst``: a burst of edits and the stock pipeline's in-process run of it;
``openloop``: Poisson load against a stack and the rules judging it; ``phases``: a job's time per
phase from its record; ``e2e_gpu_report``: the GPU end-to-end report; ``ablations``: engine
settings changed for one run (bucket growth, widening). Traces: ``ops.sim.traces``
(``ops/data/mask_ratios``), re-exported here.
"""

from ops.sim.traces import TRACES, load_trace

__all__ = ["TRACES", "load_trace"]
