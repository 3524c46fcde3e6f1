"""Parity of the Flax RAT backbone with the PyTorch reference (reference_compat=True).

Needs the ``reference`` extra (``pip install -e '.[dev,reference]'``); skipped only when torch
itself is absent. Random weights (biases, norms and the RoSE spacing transform perturbed away
from their init so every parameter matters), random inputs, float32; tolerance 1e-4 relative
(max |ours - ref| / max |ref|) on tokens and on the chained grouping maps.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch not installed: pip install -e '.[reference]' to run parity tests")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrat.models.torch_import import convert_state_dict, import_reference_package, load_reference_backbone  # noqa: E402

TOL = 1e-4
BASE = dict(feature_dims=32, num_blocks=2, num_heads=4, iters=2)


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(ours - ref).max() / (np.abs(ref).max() + 1e-30))


def reference_model(cfg: dict, seed: int = 0):
    ref = import_reference_package()
    torch.manual_seed(seed)
    model = ref.ResolutionAwareTransformer(**cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("scale_d"):
                p.uniform_(0.5, 2.0)
            elif "scale_" in name:
                p.add_(torch.randn_like(p) * 0.3)
            elif name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def inputs(sizes, channels, masks, seed=0):
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((2, channels) + tuple(s)).astype(np.float32) for s in sizes]
    ms = [(rng.random((2,) + tuple(s)) > 0.97).astype(np.float32) for s in sizes] if masks else None
    return xs, ms


def flax_forward(model, xs, spacing, ms):
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, xs, ms):
        out = nnx.merge(graphdef, state)(xs, input_spacing=spacing, mask=ms, return_maps=True)
        return [(o.tokens, o.attn_q, o.attn_k) for o in out]

    jx = [jnp.asarray(np.moveaxis(x, 1, -1)) for x in xs]
    jm = [jnp.asarray(m) for m in ms] if ms else None
    return run(state, jx, jm)


CASES = {
    "single": dict(cfg=BASE, sizes=[(20, 20)]),
    "pyramid3": dict(cfg=BASE, sizes=[(24, 24), (12, 12), (6, 6)], spacing=[(1.0, 1.0), (2.0, 2.0), (4.0, 4.0)]),
    "nonsquare_aniso": dict(cfg=BASE, sizes=[(20, 14)], spacing=[(1.0, 2.5)]),
    "masks_pyramid": dict(cfg=BASE, sizes=[(18, 18), (9, 9)], masks=True),
    "rope": dict(cfg=dict(BASE, rose_initial_scaling="rope"), sizes=[(16, 16)], spacing=[(1.0, 1.0)]),
    "identity": dict(cfg=dict(BASE, rose_initial_scaling="identity"), sizes=[(16, 12)], spacing=[(0.5, 1.5)]),
    "frozen_rose_full_ratio": dict(cfg=dict(BASE, learnable_rose=False, learnable_rose_scaling=False, rotary_ratio=1.0),
                                   sizes=[(15, 15)]),
    "no_rotation": dict(cfg=dict(BASE, rotary_ratio=0.0), sizes=[(15, 15)]),
    "3d": dict(cfg=BASE, sizes=[(8, 9, 10)], sd=3, spacing=[(2.0, 1.0, 1.0)]),
    "1d_kernel5_stride2": dict(cfg=dict(BASE, sga_kernel_size=5, stride=2, proj_kernel_size=3, iters=1), sizes=[(40,)],
                               sd=1),
    "leading_tokens": dict(cfg=dict(BASE, leading_tokens=2, num_heads=2, mlp_ratio=2), sizes=[(12, 12)], channels=1),
}


@pytest.mark.parametrize("kernels", ["cpu", "portable"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_parity(name, kernels):
    case = CASES[name]
    sd, channels = case.get("sd", 2), case.get("channels", 3)
    cfg = dict(case["cfg"], spatial_dims=sd, input_features=channels)
    model = reference_model(cfg).eval()
    xs, ms = inputs(case["sizes"], channels, case.get("masks", False))
    spacing = case.get("spacing")
    with torch.no_grad():
        ref_out = model([torch.from_numpy(x) for x in xs], input_spacing=spacing,
                        mask=[torch.from_numpy(m) for m in ms] if ms else None)
    ours = load_reference_backbone(model.state_dict(), cfg, reference_compat=True, kernels=kernels)
    ours.eval()
    arrays = flax_forward(ours, xs, spacing, ms)
    assert len(arrays) == len(ref_out)
    for (tokens, attn_q, attn_k), r in zip(arrays, ref_out):
        assert tokens.shape == tuple(r["x_out"].shape)
        errs = [rel_err(tokens, r["x_out"]), rel_err(attn_q, r["attn_q"]), rel_err(attn_k, r["attn_k"])]
        print(f"parity {name}: rel err tokens {errs[0]:.1e} attn_q {errs[1]:.1e} attn_k {errs[2]:.1e}")
        assert max(errs) <= TOL, f"{name}: rel errors tokens/attn_q/attn_k = {errs}"


def test_grid_and_spacing_match_reference():
    cfg = dict(BASE, spatial_dims=2, input_features=3, num_blocks=3)
    model = reference_model(cfg).eval()
    xs, _ = inputs([(23, 31), (12, 16)], 3, False)
    spacing = [(1.0, 0.5), (2.0, 1.0)]
    with torch.no_grad():
        ref_out = model([torch.from_numpy(x) for x in xs], input_spacing=spacing)
    ours = load_reference_backbone(model.state_dict(), cfg, reference_compat=True)
    # Jitted: one compile of the whole forward instead of one per eager op (the grid and spacing are static).
    out = nnx.jit(lambda m, xs: m(xs, input_spacing=spacing))(ours, [jnp.asarray(np.moveaxis(x, 1, -1)) for x in xs])
    for o, r in zip(out, ref_out):
        assert o.grid_shape == tuple(r["out_grid_shape"])
        np.testing.assert_allclose(o.spacing, r["out_spacing"])
        assert rel_err(o.tokens, r["x_out"]) <= TOL


@pytest.mark.parametrize("kernels", ["cpu", "portable"])
def test_gradient_parity(kernels):
    """Parameter and input gradients of a scalar loss agree (checks the custom backward passes)."""
    cfg = dict(BASE, spatial_dims=2, input_features=3)
    model = reference_model(cfg)
    model.train()  # dropout rates are 0: train mode only exercises the training code path
    xs, _ = inputs([(18, 18), (9, 9)], 3, False)
    spacing = [(1.0, 1.0), (2.0, 2.0)]
    tx = [torch.from_numpy(x).requires_grad_(True) for x in xs]
    loss = sum((o["x_out"] ** 2).mean() for o in model(tx, input_spacing=spacing))
    loss.backward()
    ref_grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}

    ours = load_reference_backbone(model.state_dict(), cfg, reference_compat=True, kernels=kernels)
    graphdef, params, rest = nnx.split(ours, nnx.Param, ...)

    def loss_fn(params, xs):
        out = nnx.merge(graphdef, params, rest)(xs, input_spacing=spacing)
        return sum(jnp.mean(o.tokens**2) for o in out)

    jx = [jnp.asarray(np.moveaxis(x, 1, -1)) for x in xs]
    g_params, g_x = jax.jit(jax.grad(loss_fn, argnums=(0, 1)))(params, jx)
    expected = convert_state_dict(ref_grads, ours)
    got = nnx.to_pure_dict(g_params)
    worst = 0.0
    flat = jax.tree_util.tree_flatten_with_path
    for (path, e), (_, g) in zip(flat(expected)[0], flat(got)[0]):
        if np.abs(e).max() == 0 and np.abs(g).max() == 0:
            continue
        err = rel_err(g, e)
        worst = max(worst, err)
        assert err <= 1e-3, f"grad {jax.tree_util.keystr(path)}: rel err {err}"
    for gx, t in zip(g_x, tx):
        worst = max(worst, rel_err(gx, np.moveaxis(t.grad.numpy(), 1, -1)))
        assert worst <= 1e-3
    print(f"parity gradients: worst rel err {worst:.1e}")


def test_reference_head_upsampling_matches_torch_bilinear():
    """The reference head upsamples with F.interpolate(bilinear, align_corners=False)."""
    from jaxrat.models.rat.heads import resize_to

    x = np.random.default_rng(0).standard_normal((2, 4, 5, 3)).astype(np.float32)
    want = torch.nn.functional.interpolate(torch.from_numpy(x).permute(0, 3, 1, 2), size=(64, 48),
                                           mode="bilinear", align_corners=False).permute(0, 2, 3, 1).numpy()
    np.testing.assert_allclose(resize_to(jnp.asarray(x), (64, 48)), want, rtol=1e-5, atol=1e-5)
