"""TransUNet and Swin-UNet (configs/isic.py's transunet_demo and swin_unet_demo, shrunk): they train,
their loss falls, and a run killed with -9 after its first checkpoint resumes to the same losses."""

import jax.numpy as jnp
import pytest
from flax import nnx

from jaxrat import ops
from jaxrat.models.swin_unet import SwinUNet
from jaxrat.models.transunet import TransUNet
from jaxrat.runtime.errors import ConfigError
from runner import REPO, env_with_devices, kill_when_ready, losses_by_step, main_cmd, run_main

SMALL = ("--config.data.image_size=32", "--config.model.backbone_fields.img_size=32",
         "--config.data.synthetic_train=32", "--config.data.synthetic_val=8", "--config.data.synthetic_image_size=64",
         "--config.data.batch_size=8", "--config.data.eval_batch_size=8", "--config.data.num_workers=0",
         "--config.num_train_steps=9", "--config.optimizer.warmup_steps=2", "--config.train.eval_every=3",
         "--config.checkpoint.every_steps=3", "--config.train.log_every=1", "--config.train.log_images=False",
         "--config.task.eval_original_resolution=False")


def test_shapes_and_wrong_backbones():
    x = jnp.zeros((1, 32, 32, 3))
    t = TransUNet(backbone="vit_tiny_patch16_224", backbone_fields=dict(img_size=32, patch_size=4, embed_dim=16,
                                                                        depth=1, num_heads=2),
                  skip_features=(4,), decoder_features=(8, 8), kernels=ops.PORTABLE, rngs=nnx.Rngs(0))
    assert t(x).shape == (1, 32, 32, 1)
    s = SwinUNet(backbone="swin_tiny_patch4_window7_224", backbone_fields=dict(img_size=32, embed_dim=8,
                                                                              depths=(1, 1), num_heads=(1, 2),
                                                                              window_size=2),
                 kernels=ops.PORTABLE, rngs=nnx.Rngs(0))
    assert s(x).shape == (1, 32, 32, 1)
    with pytest.raises(ConfigError, match="needs a ViT or BEiT backbone"):
        TransUNet(backbone="swin_tiny_patch4_window7_224", kernels=ops.PORTABLE, rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match="needs a Swin backbone"):
        SwinUNet(backbone="vit_tiny_patch16_224", kernels=ops.PORTABLE, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("variant", ["transunet_demo", "swin_unet_demo"])
def test_demo_trains_and_resumes_exactly_after_kill(variant, tmp_path, monkeypatch):
    config = f"{REPO}/configs/isic.py:{variant}"
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    run_main(straight, *SMALL, config=config)
    for key, value in env_with_devices(1).items():  # the killed run sees the devices run_main gives
        monkeypatch.setenv(key, value)
    kill_when_ready(main_cmd(resumed, *SMALL, config=config), f"{resumed}/checkpoints/3", "the first checkpoint",
                    timeout=240)
    run_main(resumed, *SMALL, config=config)
    a, b = losses_by_step(straight), losses_by_step(resumed)
    assert a[9] < a[1], (a[1], a[9])
    for step in range(4, 10):
        assert b[step] == a[step], (step, b[step], a[step])
