"""What the quick benchmarks' forkserver imports once (``tests/support/bench_launch.py``): the
heavy third-party packages, never the project's own modules."""

import boto3  # noqa: F401
import celery  # noqa: F401
import diffusers  # noqa: F401
import matplotlib  # noqa: F401
import numpy  # noqa: F401
import peft  # noqa: F401
import redis  # noqa: F401
import safetensors.torch  # noqa: F401
import scipy.ndimage  # noqa: F401
import skimage.color  # noqa: F401
import skimage.feature  # noqa: F401
import skimage.metrics  # noqa: F401
import sklearn.linear_model  # noqa: F401
import sklearn.svm  # noqa: F401
import torch  # noqa: F401
from diffusers import (  # noqa: F401
    AutoencoderKL,
    ControlNetModel,
    FluxFillPipeline,
    FluxTransformer2DModel,
    StableDiffusionInpaintPipeline,
    StableDiffusionXLInpaintPipeline,
    UNet2DConditionModel,
)
from PIL import Image  # noqa: F401
from transformers import CLIPTextModel, CLIPTokenizer  # noqa: F401
