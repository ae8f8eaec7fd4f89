"""Mask-aware computation: token masks, the UNet controller and the template activation store.

Masked tokens are computed; unmasked tokens take their activations from a template's cache
(DESIGN.md sections 2 and 6). See ``unet.py`` for the controller API and cache layout.
"""

from workers.maskaware.activation_store import ActivationStore, CacheKeyMismatch, CacheNotFound, TemplateCacheKey
from workers.maskaware.tokens import TokenMasks, build_token_masks, mask_ratio
from workers.maskaware.unet import BatchContext, MaskAwareUNet, RowGroup

__all__ = [
    "ActivationStore",
    "BatchContext",
    "CacheKeyMismatch",
    "CacheNotFound",
    "MaskAwareUNet",
    "RowGroup",
    "TemplateCacheKey",
    "TokenMasks",
    "build_token_masks",
    "mask_ratio",
]
