"""One line that says how a model directory stores its weights, for people (/state, the dashboard).

"q4_1→affine4/g32, q8_0→affine8/g32" for a GGUF import that kept its quantization (≈ where a form is not
exact), "mlx 4-bit g64" for an MLX-quantized directory (mlx_lm.convert -q), else the float dtype that holds
most of the bytes ("float32", "bfloat16", "float16").
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

IMPORT_INFO_FILE = "shardline_import.json"  # what the GGUF importer wrote, beside the weights
# Bytes per element of each safetensors dtype: a tensor's size must be its shape's product times this.
SAFETENSORS_ITEMSIZE = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip
FLOAT_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def import_label(model_dir: Path) -> str:
    """The weight format a GGUF import recorded ("" for a directory the importer did not write)."""
    try:
        info = json.loads((model_dir / IMPORT_INFO_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    label = info.get("weight_format") if isinstance(info, dict) else None
    return label if isinstance(label, str) else ""


def _mlx_label(quantization: Mapping[str, Any]) -> str:
    def one(q: Mapping[str, Any]) -> str:
        mode = q.get("mode", "affine")
        if mode != "affine":
            return f"{mode} g{q.get('group_size')}"
        return f"{q.get('bits')}-bit g{q.get('group_size')}"

    default = one(quantization)
    others = Counter(one(v) for v in quantization.values() if isinstance(v, Mapping))
    others.pop(default, None)
    extra = "".join(f" + {form}" for form, _ in others.most_common())
    return f"mlx {default}{extra}"


def describe_weights(model_dir: Path, config: Mapping[str, Any], bytes_by_dtype: Mapping[str, int]) -> str:
    """The label of `model_dir`, from its import record, its config and its tensors' bytes per dtype."""
    if label := import_label(Path(model_dir)):
        return label
    quantization = config.get("quantization")
    if isinstance(quantization, Mapping) and "bits" in quantization:
        return _mlx_label(quantization)
    floats = {d: n for d, n in bytes_by_dtype.items() if d in FLOAT_NAMES}
    if not floats:
        return ""
    return FLOAT_NAMES[max(floats, key=lambda d: floats[d])]
