"""Random but non-trivial LoRA adapters (shared with the benchmarks: ``ops/bench/harness/addons.py``)."""

from ops.bench.harness.addons import save_flux_lora, save_sd_lora

__all__ = ["save_flux_lora", "save_sd_lora"]
