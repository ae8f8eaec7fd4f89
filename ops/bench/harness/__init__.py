"""The harness every benchmark runs on; benchmarks import only it, ``ops.sim`` and the product.

- ``cli``: the shared options (``--quick``, ``--out``, ``--threads``, ``--seed``, ``--clock``),
  logging, torch threads, the exact command line a report cites;
- ``timing``: clocks (wall, thread CPU), the side-by-side runner, medians, paired ratios, fits;
- ``report``: Markdown files and marked sections of shared ones, plots;
- ``models``: benchmark-size models and masks; ``engine``: jobs through the engine in process,
  per-step costs, the batch curve; ``edits``: model families, warm-ups, edits under a fidelity
  option, image metrics.

Trace loading is the simulator's (``ops.sim.traces``, the traces in ``ops/data/mask_ratios``),
re-exported here so that benchmarks, simulator and training read the same files one way.
"""

from ops.sim.traces import TRACES, load_trace

__all__ = ["TRACES", "load_trace"]
