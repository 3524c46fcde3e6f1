"""Mixup and CutMix inside the jitted step: mix each example with its neighbour in the batch.

The mixed batch keeps its sharding (the partner is the next row, a shift of one), and the task mixes
the targets with the returned ``(lam, partner)`` as it mixes the images.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def mix_batch(images: jax.Array, rng: jax.Array, mixup_alpha: float,
              cutmix_alpha: float) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    """(images, (lam, partner index)) with ``lam`` the share of each example's own pixels; ``None``
    instead of the pair when both alphas are 0. With both on, each micro-batch picks one at random."""
    if mixup_alpha <= 0 and cutmix_alpha <= 0:
        return images, None
    b, h, w = images.shape[:3]
    partner = (jnp.arange(b) + 1) % b
    k_pick, k_mix, k_cut, k_y, k_x = jax.random.split(rng, 5)
    use_cut = (jax.random.uniform(k_pick) < 0.5) if mixup_alpha > 0 and cutmix_alpha > 0 else cutmix_alpha > 0
    lam_mix = jax.random.beta(k_mix, mixup_alpha, mixup_alpha) if mixup_alpha > 0 else jnp.float32(1)
    lam_cut = jax.random.beta(k_cut, cutmix_alpha, cutmix_alpha) if cutmix_alpha > 0 else jnp.float32(1)
    other = images[partner]
    mixed = lam_mix * images + (1 - lam_mix) * other
    # CutMix: a box of about (1 - lam) of the area, clipped at the border; lam is then the exact share kept.
    ch, cw = jnp.sqrt(1 - lam_cut) * h, jnp.sqrt(1 - lam_cut) * w
    cy, cx = jax.random.uniform(k_y) * h, jax.random.uniform(k_x) * w
    ys, xs = jnp.arange(h)[:, None], jnp.arange(w)[None, :]
    box = (jnp.abs(ys + 0.5 - cy) < ch / 2) & (jnp.abs(xs + 0.5 - cx) < cw / 2)
    cut = jnp.where(box[None, :, :, None], other, images)
    lam_cut = 1 - box.mean()
    out = jnp.where(use_cut, cut, mixed)
    lam = jnp.where(use_cut, lam_cut, lam_mix).astype(jnp.float32)
    return out, (lam, partner)
