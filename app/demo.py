"""``stencil demo``: the main job on embedded defaults, end to end through every process.

Starts an embedded stack, submits N edits of images that ship with scikit-image through the
Python client, with masks of different shapes and sizes, waits, writes the result PNGs and
``summary.json``, prints a table, and shuts everything down. Exit status 1 if any job failed.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

from PIL import Image

from app.maskgen import SHAPES, make_mask

log = logging.getLogger(__name__)

PROMPTS = ["a red scarf", "a cup of coffee", "a cat", "an astronaut", "a green hat", "flowers"]
RATIOS = [0.05, 0.15, 0.3, 0.5, 0.1, 0.25]


def demo_templates(size: int = 128) -> list[tuple[str, Image.Image]]:
    """Template images bundled with scikit-image (no downloads)."""
    from skimage import data

    out = []
    for name in ("astronaut", "chelsea", "coffee", "rocket"):
        arr = getattr(data, name)()
        img = Image.fromarray(arr).convert("RGB")
        side = min(img.size)
        img = img.crop(((img.width - side) // 2, (img.height - side) // 2,
                        (img.width + side) // 2, (img.height + side) // 2)).resize((size, size))
        out.append((name, img))
    return out


def run_demo(jobs: int, out_dir: Path, steps: int = 20, timeout: float = 600.0) -> int:
    from app.client import StencilClient
    from app.embedded import EmbeddedStack

    out_dir.mkdir(parents=True, exist_ok=True)
    templates = demo_templates()
    t0 = time.monotonic()
    with EmbeddedStack.start() as stack:
        log.info("embedded stack up in %.1fs (redis %s)", time.monotonic() - t0, stack.settings.redis_url)
        client = StencilClient(stack.settings)
        handles = []
        for i in range(jobs):
            name, image = templates[i % len(templates)]
            ratio = RATIOS[i % len(RATIOS)]
            mask = make_mask(ratio, image.size, SHAPES[i % len(SHAPES)], seed=i)
            handle = client.submit(template=image, mask=mask, prompt=PROMPTS[i % len(PROMPTS)],
                                   steps=steps, guidance=7.5, seed=1000 + i)
            handles.append((handle, name, float(mask.mean()), time.time()))
        rows = []
        failed = 0
        for i, (handle, name, ratio, submitted) in enumerate(handles):
            rec = handle.wait(timeout)
            row = {"id": handle.id, "template": name, "status": rec.status.value,
                   "mask_ratio": round(ratio, 4), "error": rec.error,
                   "latency_s": round((rec.ts("done") or rec.ts(rec.status) or time.time()) - submitted, 3)}
            if rec.status.value == "done":
                path = out_dir / f"job{i:02d}_{name}.png"
                path.write_bytes(handle.result_bytes())
                row["output"] = str(path)
            else:
                failed += 1
            rows.append(row)
    (out_dir / "summary.json").write_text(json.dumps({"jobs": rows}, indent=2))
    sys.stdout.write(f"{'job':<34} {'template':<10} {'mask':>6} {'status':<8} {'latency':>8}\n")
    for row in rows:
        sys.stdout.write(f"{row['id']:<34} {row['template']:<10} {row['mask_ratio']:>6.3f} "
                         f"{row['status']:<8} {row['latency_s']:>7.2f}s\n")
    sys.stdout.write(f"{len(rows) - failed}/{len(rows)} done; results in {out_dir}\n")
    return 1 if failed else 0
