"""The canonical form of a LoRA adapter inside Stencil, whatever format it was uploaded in.

Per model component (``unet``, ``transformer``, ``text_encoder``, ``text_encoder_2``) and module
path: the down (``lora_A``) and up (``lora_B``) weights and the module's scaling (PEFT's
``lora_alpha / r``, with rank and alpha patterns already resolved by diffusers' and PEFT's own
loaders at conversion time, ``convert.py``). An adapter used at scale ``s`` adds
``s * scaling * B @ A`` to the module's weight, exactly what diffusers' ``load_lora_weights`` +
``set_adapters([...], [s])`` computes (unfused) or ``fuse_lora`` merges.

Stored as one safetensors file (no pickle): tensors ``"<component>.<path>.lora_A"`` /
``".lora_B"`` and, in the header metadata, the per-module scalings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from app.storage.hostcache import to_device
from workers.weights_format import read_header

FORMAT = "stencil-lora-1"
COMPONENTS = ("unet", "transformer", "text_encoder", "text_encoder_2")


@dataclass(frozen=True)
class LoraModule:
    """One adapted module: ``down`` [r, in] (Linear) or [r, in, kh, kw] (Conv2d), ``up`` [out, r(, 1, 1)]."""

    down: torch.Tensor
    up: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    @property
    def conv(self) -> bool:
        return self.down.dim() == 4

    def delta(self, coeff: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``coeff * scaling * B @ A`` shaped like the base module's weight."""
        up = self.up.reshape(self.up.shape[0], -1).to(dtype)
        down = self.down.reshape(self.rank, -1).to(dtype)
        out = (up * (coeff * self.scaling)) @ down
        return out.view(self.up.shape[0], *self.down.shape[1:]) if self.conv else out

    def to(self, device: torch.device | str, dtype: torch.dtype) -> "LoraModule":
        """On ``device`` in ``dtype``; to a GPU pinned, on a copy stream (a pageable copy would wait
        for the GPU's queue in the middle of a step)."""
        return LoraModule(to_device(self.down, device).to(dtype), to_device(self.up, device).to(dtype), self.scaling)


@dataclass
class LoraWeights:
    """An adapter: component -> module path -> ``LoraModule``."""

    lora_id: str
    components: dict[str, dict[str, LoraModule]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(m.down.numel() * m.down.element_size() + m.up.numel() * m.up.element_size()
                   for mods in self.components.values() for m in mods.values())

    def modules(self, component: str) -> dict[str, LoraModule]:
        return self.components.get(component, {})

    def describe(self) -> dict[str, object]:
        """What ``stencil lora list`` shows (and the dispatcher's fetch estimate uses)."""
        out: dict[str, object] = {"nbytes": self.nbytes, "components": {}}
        for comp, mods in self.components.items():
            ranks = sorted({m.rank for m in mods.values()})
            out["components"][comp] = {"modules": len(mods), "ranks": ranks,  # type: ignore[index]
                                       "conv_modules": sum(m.conv for m in mods.values())}
        return out

    def to_bytes(self) -> bytes:
        tensors: dict[str, torch.Tensor] = {}
        scalings: dict[str, float] = {}
        for comp, mods in self.components.items():
            for path, m in mods.items():
                tensors[f"{comp}.{path}.lora_A"] = m.down.contiguous()
                tensors[f"{comp}.{path}.lora_B"] = m.up.contiguous()
                scalings[f"{comp}.{path}"] = float(m.scaling)
        return st_save(tensors, metadata={"format": FORMAT, "lora_id": self.lora_id,
                                          "scalings": json.dumps(scalings)})

    @classmethod
    def from_bytes(cls, data: bytes) -> "LoraWeights":
        """Read the canonical file (written by ``to_bytes``; safetensors, never pickle)."""
        meta = read_header(data).metadata
        if meta.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} file")
        scalings: dict[str, float] = json.loads(meta["scalings"])
        tensors = st_load(data)
        out = cls(meta.get("lora_id", ""))
        for name, scaling in scalings.items():
            comp, _, path = name.partition(".")
            out.components.setdefault(comp, {})[path] = LoraModule(
                tensors[f"{name}.lora_A"], tensors[f"{name}.lora_B"], scaling)
        return out


__all__ = ["COMPONENTS", "FORMAT", "LoraModule", "LoraWeights"]
