"""Kernels over the whole parameter tree, for GPUs: the optimizer's update and the parameters'
moving average, and the step's one cast of the weights it reads narrow.

They are not the model's operations (:mod:`jaxrat.ops`): each walks every parameter leaf at once, a
multi-tensor kernel (:mod:`jaxrat.optim.multi_tensor`) in place of a kernel per leaf. The trainer
chooses them (:mod:`jaxrat.trainer.fused_optimizer`, :mod:`jaxrat.trainer.param_cast`); the gpu
policy's forms ``adamw``, ``ema`` and ``cast`` (:data:`jaxrat.ops.forms.FORMS`) are fingerprinted by
these files.

- :mod:`jaxrat.optim.gpu_adamw`: AdamW, optax's chain operation for operation;
- :mod:`jaxrat.optim.gpu_ema`: the moving average of the parameters;
- :mod:`jaxrat.optim.gpu_cast`: float32 weights cast to bfloat16 or float16.
"""
