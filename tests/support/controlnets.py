"""Small ControlNets that do something (shared with the benchmarks: ``ops/bench/harness/addons.py``)."""

from ops.bench.harness.addons import make_controlnet, save_controlnet

__all__ = ["make_controlnet", "save_controlnet"]
