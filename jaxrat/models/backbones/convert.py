"""Weights of timm's and Hugging Face's ViT, BEiT and Swin as this package's parameter names.

:func:`hf_to_timm` renames a Hugging Face state dict (the hub's names and transformers 5's) to
timm's; :func:`timm_to_jaxrat` turns timm's names and layouts into these backbones' (Linear
``(out, in)`` -> kernel ``(in, out)``, Conv ``(out, in, kh, kw)`` -> ``(kh, kw, in, out)``, LayerNorm
``weight`` -> ``scale``); :func:`fit` resamples what depends on the image size (ViT position
embeddings, BEiT and Swin bias tables) to the model's, as the file's library does when it loads
them. :func:`checkpoint_filter` is the three in a row (timm's ``checkpoint_filter_fn``), on the
named arrays :func:`jaxrat.checkpointing.weight_files.read_arrays` reads. Pure numpy: converting
needs neither torch nor the model libraries.
"""

from __future__ import annotations

import re
from typing import Mapping

import numpy as np

# (pattern, replacement) applied in order to a Hugging Face name with its "vit."/"beit."/"swin." prefix removed.
_HF_RULES = [
    (r"^embeddings\.cls_token$", "cls_token"),
    (r"^embeddings\.position_embeddings$", "pos_embed"),
    (r"^embeddings\.patch_embeddings\.projection\.", "patch_embed.proj."),
    (r"^embeddings\.norm\.", "patch_embed.norm."),
    (r"^(?:encoder\.layer|layers)\.(\d+)\.", r"blocks.\1."),  # ViT / BEiT blocks
    (r"^encoder\.layers\.(\d+)\.blocks\.", r"layers.\1.blocks."),  # Swin blocks
    (r"^encoder\.layers\.(\d+)\.downsample\.", r"merge_after.\1."),  # Swin: timm merges at the next stage's start
    (r"\.attention\.(?:attention|self)\.(query|key|value)\.", r".attn.\1."),
    (r"\.attention\.(q|k|v)_proj\.", r".attn.\1."),
    (r"\.attention\.(?:attention\.|self\.)?relative_position_bias\.relative_position_bias_table$",
     ".attn.relative_position_bias_table"),
    (r"\.attention\.self\.relative_position_bias_table$", ".attn.relative_position_bias_table"),
    (r"\.attention\.(?:output\.dense|o_proj)\.", ".attn.proj."),
    (r"\.(?:intermediate\.dense|mlp\.fc1)\.", ".mlp.fc1."),
    (r"\.(?:output\.dense|mlp\.fc2)\.", ".mlp.fc2."),
    (r"\.layernorm_before\.", ".norm1."),
    (r"\.layernorm_after\.", ".norm2."),
    (r"\.lambda_1$", ".gamma_1"),
    (r"\.lambda_2$", ".gamma_2"),
    (r"^pooler\.layernorm\.", "fc_norm."),
    (r"^layernorm\.", "norm."),
    (r"^classifier\.", "head."),
]
_QKV = {"query": "q", "key": "k", "value": "v"}


def is_hf(state: Mapping[str, np.ndarray]) -> bool:
    """Whether a state dict uses Hugging Face's names (``vit.embeddings...``) rather than timm's."""
    return any(re.match(r"^(?:vit|beit|swin)\.|^embeddings\.", k) for k in state)


def hf_to_timm(state: Mapping[str, np.ndarray], sources: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """A Hugging Face ViT/BEiT/Swin state dict with timm's names (q, k and v joined into ``qkv``);
    ``sources``, when given, receives timm name -> the file's key (the query's for a joined qkv)."""
    sources = {} if sources is None else sources
    renamed: dict[str, np.ndarray] = {}
    origin: dict[str, str] = {}
    for key, value in state.items():
        name = re.sub(r"^(?:vit|beit|swin)\.", "", key)
        if name.startswith("pooler.dense") or name.endswith("relative_position_index"):
            continue  # the ViT pooler is not timm's; the index is recomputed
        for pattern, repl in _HF_RULES:
            name = re.sub(pattern, repl, name)
        m = re.match(r"^merge_after\.(\d+)\.(.*)$", name)
        if m:
            name = f"layers.{int(m.group(1)) + 1}.downsample.{m.group(2)}"
        renamed[name] = value
        origin[name] = key
    out: dict[str, np.ndarray] = {}
    groups: dict[str, dict[str, np.ndarray]] = {}
    for name, value in renamed.items():
        m = re.match(r"^(.*\.attn)\.(query|key|value|q|k|v)\.(weight|bias)$", name)
        if m:
            part = _QKV.get(m.group(2), m.group(2))
            groups.setdefault(m.group(1), {})[part + m.group(3)] = value
            if part == "q":  # the joined qkv is named by its query's key; BEiT's v_bias by its value's
                sources[f"{m.group(1)}.qkv.{m.group(3)}"] = sources[f"{m.group(1)}.q_{m.group(3)}"] = origin[name]
            elif part == "v":
                sources[f"{m.group(1)}.v_{m.group(3)}"] = origin[name]
        else:
            out[name] = value
            sources[name] = origin[name]
    for prefix, parts in groups.items():
        out[f"{prefix}.qkv.weight"] = np.concatenate([parts["qweight"], parts["kweight"], parts["vweight"]])
        if "kbias" in parts:  # ViT, Swin: one bias over q, k and v
            out[f"{prefix}.qkv.bias"] = np.concatenate([parts["qbias"], parts["kbias"], parts["vbias"]])
        elif "qbias" in parts:  # BEiT: q and v biases, k none
            out[f"{prefix}.q_bias"], out[f"{prefix}.v_bias"] = parts["qbias"], parts["vbias"]
    return out


def timm_to_jaxrat(state: Mapping[str, np.ndarray], sources: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """timm names and layouts to this package's parameter paths (``blocks/0/attn/qkv/kernel``);
    ``sources``, when given, is rekeyed in place from timm names to these paths."""
    out = {}
    renamed: dict[str, str] = {}
    for key, value in state.items():
        if key.endswith(("relative_position_index", "attn_mask", "k_bias")):
            continue  # buffers, recomputed here
        value = np.asarray(value, np.float32)
        parts = key.split(".")
        if parts[:2] == ["head", "fc"]:  # Swin's ClassifierHead
            parts = ["head", *parts[2:]]
        last = parts[-1]
        if last == "weight":
            if value.ndim == 4:
                value, last = value.transpose(2, 3, 1, 0), "kernel"
            elif value.ndim == 2:
                value, last = value.T, "kernel"
            else:
                last = "scale"
        out["/".join([*parts[:-1], last])] = np.ascontiguousarray(value)
        renamed["/".join([*parts[:-1], last])] = key
    if sources is not None:
        timm_sources = dict(sources)
        sources.clear()
        sources.update({ours: timm_sources.get(theirs, theirs) for ours, theirs in renamed.items()})
    return out


def file_name(name: str) -> str:
    """The timm name of a parameter path of these backbones (what a timm file calls it)."""
    parts = name.split("/")
    last = {"kernel": "weight", "scale": "weight"}.get(parts[-1], parts[-1])
    return ".".join([*parts[:-1], last])


def checkpoint_filter(state: Mapping[str, np.ndarray], expected: Mapping[str, tuple],
                      origin: str = "") -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """timm's ``checkpoint_filter_fn`` for these backbones: a timm or Hugging Face state dict
    (``origin`` "timm"/"hf"; default: by its names) as (arrays by this package's paths, resampled to
    the ``expected`` shapes; path -> the file's own key, for messages)."""
    hf = is_hf(state)
    sources: dict[str, str] = {}
    named = timm_to_jaxrat(hf_to_timm(state, sources) if hf else state, sources)
    return fit(named, expected, origin or ("hf" if hf else "timm")), sources


def resize_rel_table(table: np.ndarray, window: tuple[int, int], extra: int) -> np.ndarray:
    """A (positions + extra, heads) relative-position table of a square window resampled for
    ``window``: timm's ``resize_rel_pos_bias_table`` (BEiT's geometric spacing, linear interpolation)."""
    src = int(round((table.shape[0] - extra) ** 0.5))
    dst = (2 * window[0] - 1, 2 * window[1] - 1)
    if (src, src) == dst:
        return table
    body, tail = table[:table.shape[0] - extra], table[table.shape[0] - extra:]

    def positions(s: int, d: int) -> np.ndarray:
        left, right = 1.01, 1.5
        while right - left > 1e-6:
            q = (left + right) / 2.0
            if (1.0 - q ** (s // 2)) / (1.0 - q) > d // 2:
                right = q
            else:
                left = q
        dis, cur = [], 1.0
        for i in range(s // 2):
            dis.append(cur)
            cur += q ** (i + 1)
        return np.asarray([-x for x in reversed(dis)] + [0.0] + dis, np.float32)

    ys, xs = positions(src, dst[0]), positions(src, dst[1])
    ty, tx = dst[0] // 2, dst[1] // 2
    dy, dx = np.arange(-ty, ty + 0.1, 1.0, dtype=np.float32), np.arange(-tx, tx + 0.1, 1.0, dtype=np.float32)
    grid = body.reshape(src, src, -1).astype(np.float32)
    along_x = np.stack([[np.interp(dx, xs, grid[i, :, h]) for i in range(src)] for h in range(grid.shape[-1])])
    full = np.stack([[np.interp(dy, ys, along_x[h, :, j]) for j in range(len(dx))] for h in range(grid.shape[-1])])
    resized = full.transpose(2, 1, 0).reshape(-1, grid.shape[-1])  # (dy, dx, heads) flattened
    return np.concatenate([resized, tail]).astype(np.float32)


def fit(arrays: dict[str, np.ndarray], expected: Mapping[str, tuple], origin: str = "timm") -> dict[str, np.ndarray]:
    """``arrays`` with position embeddings and bias tables of another image size resampled to the
    ``expected`` shapes (the model's) as the library the file comes from (``origin``: "timm" or
    "hf") does it; every other entry unchanged.

    timm: ``resample_abs_pos_embed`` (bicubic, antialiased) and ``resize_rel_pos_bias_table``
    (BEiT's geometric spacing). Hugging Face: plain bicubic for position embeddings and bilinear for
    BEiT's tables (``align_corners=False``, no antialias); its Swin never resizes a table (its
    window is the config's), so a Swin table of another window follows timm's rule.
    """
    from jaxrat.models.backbones.vit import resample_grid, resample_pos_embed

    out = dict(arrays)
    for name, value in arrays.items():
        want = tuple(expected.get(name, value.shape))
        if value.shape == want:
            continue
        if name == "pos_embed" and value.ndim == 3 and value.shape[-1] == want[-1]:
            side = int(round((want[1] - 1) ** 0.5))
            out[name] = np.asarray(resample_pos_embed(value, (side, side), rule=origin))
        elif name.endswith("relative_position_bias_table") and value.shape[1] == want[1]:
            extra = 3 if name.startswith("blocks/") else 0  # BEiT's class-token entries
            side = int(round((want[0] - extra) ** 0.5))
            if origin == "hf" and extra:
                src = int(round((value.shape[0] - extra) ** 0.5))
                body = resample_grid(value[:-extra].reshape(src, src, -1), (side, side), "bilinear")
                out[name] = np.concatenate([body.reshape(side * side, -1), value[-extra:]]).astype(np.float32)
            else:
                out[name] = resize_rel_table(value, ((side + 1) // 2,) * 2, extra)
    return out
